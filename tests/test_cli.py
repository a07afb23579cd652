"""The ``weightstream`` command, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _main(capsys, *args: str) -> tuple[int | str | None, str]:
    """``weightstream ARGS`` in this process: its exit status (or SystemExit's code) and its stdout."""
    from weightstream.cli import main

    try:
        code: int | str | None = main(list(args))
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().out


@pytest.mark.unit
def test_help_explains_each_command_and_option(capsys):
    code, out = _main(capsys, "--help")
    assert code == 0 and all(c in out for c in ("demo", "dump", "verify", "presets"))
    code, out = _main(capsys, "dump", "--help")
    for opt in ("--hf", "--preset", "--seed", "--tp", "--pp", "--vpp", "--bucket-mb", "--out", "--writers"):
        assert opt in out


@pytest.mark.unit
def test_version_is_the_package_version(capsys):
    import weightstream

    code, out = _main(capsys, "--version")
    assert code == 0 and out.strip() == f"weightstream {weightstream.__version__}"


def test_demo_proves_its_checkpoint():
    # As a user runs it: no warning filter of ours in the environment, output captured (not a terminal).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "HF_HUB_DISABLE_PROGRESS_BARS")}
    out = subprocess.run([sys.executable, "-m", "weightstream.cli", "demo"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = (out.stdout + out.stderr).splitlines()
    assert len(lines) <= 15, lines
    ours = ("[1/5] ", "[2/5] ", "[3/5] ", "[4/5] ", "[5/5] ", "      ", "PROVEN: ")
    assert [line for line in lines if not line.startswith(ours)] == [], lines
    assert not any("\r" in line or "Warning" in line for line in lines), lines
    assert "identical: 47 tensors compared" in out.stdout
    # The engine's line counts rank 0's share (each rank sends its own shards); the last line the whole model.
    assert "engine update, rank 0's share of 4 ranks: p2p" in out.stdout and "engine vs HF" in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("PROVEN: 47 tensors") and "buckets" in last and "GB/s" in last


def test_dump_then_verify(sources, tmp_path):
    out = tmp_path / "dump"
    res = run("dump", "--hf", sources["tiny-qwen2"], "--tp", "2", "--pp", "2", "--bucket-mb", "0.1", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "51 tensors" in res.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for f in set(index["weight_map"].values()) for t in load_file(out / f).values()
    )
    res = run("verify", sources["tiny-qwen2"], str(out))
    assert res.returncode == 0 and "identical: 51 tensors compared" in res.stdout


def test_verify_lists_every_difference(sources, tmp_path):
    src = sources["tiny-qwen3"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors.pop("model.norm.weight")
    tensors["model.extra.weight"] = torch.zeros(3)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].clone()
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] += 1.0
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].to(torch.bfloat16)
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.2.mlp.up_proj.weight"][:5].clone()
    other = tmp_path / "other"
    other.mkdir()
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    res = run("verify", src, str(other))
    assert res.returncode == 1
    for expected in (
        "model.norm.weight", "model.extra.weight", "model.layers.0.mlp.up_proj.weight: max abs difference 1",
        "model.layers.1.mlp.up_proj.weight: torch.float32 vs torch.bfloat16",
        "model.layers.2.mlp.up_proj.weight: (96, 64) vs (5, 64)", "DIFFERENT",
    ):
        assert expected in res.stdout, (expected, res.stdout)
    assert run("verify", src, str(other), "--atol", "2").returncode == 1  # names/dtypes/shapes still differ


def test_demo_refuses_a_non_empty_out_before_starting_anything(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    out = run("demo", "--out", str(tmp_path))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"error: {tmp_path} is not empty (it holds 1 file); refusing to write the checkpoint into it: pass "
        "overwrite=True (--overwrite) to replace it, or choose an empty or new directory"]
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_engine_on_a_corrupt_model_directory_says_what_is_wrong_in_one_line(sources, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(sources["tiny-qwen3"], bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(100_000)
    out = run("engine", "--hf", str(bad), "--port", "0", timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"error: the checkpoint {bad} cannot be read: {bad}/model.safetensors")
    (bad / "config.json").write_text('{"model_type": ')
    out = run("engine", "--hf", str(bad), "--port", "0", timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "config.json" in out.stderr


@pytest.mark.unit
def test_families_lists_every_registered_family_and_what_it_declares(capsys):
    from weightstream.converters import known_model_types

    code, stdout = _main(capsys, "families")
    assert code == 0
    lines = {line.split()[0]: line for line in stdout.splitlines()[1:-1]}
    assert sorted(lines) == known_model_types()
    assert lines["llama"].split()[:4] == ["llama", "dense", "declared", "(7"]
    assert "llama-3.1-8b" in lines["llama"] and "tiny-llama-tied" in lines["llama"]
    assert lines["mistral"].split()[1] == "dense" and "as saved" in lines["mistral"]
    assert lines["mixtral"].split()[:4] == ["mixtral", "MoE", "declared", "(7"]
    assert "3 declarations (fused experts)" in lines["mixtral"]
    assert stdout.splitlines()[-1].startswith(f"{len(known_model_types())} families")
    assert "weightstream families" in " ".join(_main(capsys, "--help")[1].split())


def test_verify_with_atol_compares_a_bf16_copy_and_notes_the_dtypes(sources, tmp_path, capsys):
    from weightstream.cli import main

    src = sources["tiny-qwen3"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    copy = tmp_path / "bf16"
    copy.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(copy / "model.safetensors"),
              metadata={"format": "pt"})
    assert main(["verify", src, str(copy)]) == 1  # bit for bit: the dtypes are the difference
    assert f"dtypes differ ({len(tensors)}):" in capsys.readouterr().out
    assert main(["verify", src, str(copy), "--atol", "1e-2"]) == 0
    out = capsys.readouterr().out
    assert f"note: dtypes differ, values compared as float within the tolerance ({len(tensors)}):" in out
    assert "  … and" in out and f"identical: {len(tensors)} tensors compared" in out
    assert main(["verify", src, str(copy), "--atol", "1e-4"]) == 1  # bf16 rounding exceeds 1e-4
    assert "values differ" in capsys.readouterr().out
