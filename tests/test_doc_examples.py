"""The examples of README.md and docs/ run as written (tests/helpers/docs.py says how blocks are marked), on the job
``weightstream example ws-example`` writes, as the README says to try them: shell blocks in that directory's parent,
Python blocks on every rank of a ``torchrun`` job over its checkpoint, into real reference engines. Where a block
names an engine's address, the address of a local engine stands in for it (each replaced text asserted present)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.docs import ROOT, Block, example
from weightstream.checks.compare import compare_checkpoints
from weightstream.converters.fp8 import quantize_weight
from weightstream.launch import free_port
from weightstream.wire.fp8 import BlockFP8

INPUT_IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433], [999, 0, 1, 2, 500, 501, 77, 88, 99, 111]]


@pytest.fixture(scope="module")
def workspace(example_job) -> Path:
    """Where the README's commands run: ``weightstream example ws-example`` done there (conftest's example_job)."""
    return example_job[0]


def _shell(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PATH": path})
    assert out.returncode == 0, f"{block.where}\n{out.stdout}\n{out.stderr}"
    return out


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    cmp = compare_checkpoints(a, b)
    assert cmp.ok, cmp.render(os.fspath(a), os.fspath(b))


def _substituted(block: Block, swaps: dict[str, str]) -> str:
    text = block.text
    for old, new in swaps.items():
        assert old in text, f"{block.where} no longer says {old!r}"
        text = text.replace(old, new)
    return text


# -- shell and single-process blocks ---------------------------------------------------------------------


def test_convert_command(workspace):
    """example:convert-cli"""
    out = _shell(example("convert-cli"), workspace)
    _assert_same_checkpoint(workspace / "ws-example" / "hf", workspace / "run1-hf")
    assert (workspace / "run1-hf" / "tokenizer.json").read_bytes() == (
        workspace / "ws-example" / "hf" / "tokenizer.json").read_bytes()
    assert "tokenizer.json" in out.stdout + out.stderr


def test_convert_api(workspace):
    """example:convert-api"""
    code = "import weightstream as ws\n" + example("convert-api").text
    out = subprocess.run([sys.executable, "-c", code], cwd=workspace, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    _assert_same_checkpoint(workspace / "ws-example" / "hf", workspace / "hf")
    assert "torch_dist" in out.stdout


def test_fp8_commands(workspace):
    """example:fp8-cli"""
    _shell(example("fp8-cli"), workspace)
    source = _weights(workspace / "ws-example" / "hf")
    for out, fmt in ((workspace / "fp8-hf", "ue8m0"), (workspace / "fp8", "float")):
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        assert (config["quant_method"], config["weight_block_size"], config.get("scale_fmt", "float")) == (
            "fp8", [128, 128], fmt)
        got = _weights(out)
        quantized = sorted(n for n, t in got.items() if t.dtype == torch.float8_e4m3fn)
        assert quantized and all(f"{n}_scale_inv" in got for n in quantized)
        if out.name == "fp8-hf":  # from the example's checkpoint: exactly the quantization of its HF weights
            fp8 = BlockFP8((128, 128), "ue8m0")
            for name in quantized:
                values, scale = quantize_weight(fp8, source[name])
                assert torch.equal(got[name].view(torch.uint8), values.view(torch.uint8)), name
                assert torch.equal(got[f"{name}_scale_inv"], scale), name


@pytest.mark.unit
def test_llama_family_declaration():
    """example:llama-family: the README's text of the Llama family declares what the family does."""
    from weightstream.converters import llama
    from weightstream.converters.qwen2 import QWEN2

    names = {"QWEN2": QWEN2, "L": llama.L}
    exec(compile(example("llama-family").text, "<llama-family>", "exec"), names)
    assert names["LLAMA"].mappings == llama.LLAMA.mappings and names["MISTRAL"].mappings == llama.MISTRAL.mappings
    config = {"model_type": "llama", "attention_bias": False}
    assert names["llama_features"](config) == llama.llama_features(config)


# -- Python blocks on every rank of a torchrun job, into reference engines -------------------------------

JOB = (  # (example, text the block says -> what stands in for it here)
    ("save", {}),
    ("stream-api", {}),
    ("stream-live", {"http://10.0.0.7:30000": "{e0}"}),
    ("load-hf", {}),
    ("update-weights", {"http://10.0.0.7:30000": "{e0}", '"10.0.0.2"': '"127.0.0.1"'}),
    ("two-engines", {"http://engine-a:30000": "{e0}", "http://engine-b:30000": "{e1}"}),
    ("delta", {}),
    ("fsdp", {"http://sglang-host:30000": "{e0}"}),
)
PRELUDE = {  # names a block uses that the job's own code would hold
    "fsdp": "import torch.distributed as dist\nfrom torch.distributed.device_mesh import init_device_mesh\n"
            "from transformers import AutoModelForCausalLM\npath = hf_config\n"
            "dp_mesh = init_device_mesh('cpu', (dist.get_world_size(),))\n",
}


@pytest.fixture(scope="module")
def job(workspace, tmp_path_factory) -> dict[str, Path]:
    """The job's blocks run in order, each in its own directory; two engines, TP 1, started on other weights."""
    from transformers import AutoConfig

    from weightstream.models.presets import random_hf_model
    from weightstream.reference_engine.server import serve, stop

    hf = workspace / "ws-example" / "hf"
    start = tmp_path_factory.mktemp("engine-start")
    random_hf_model(AutoConfig.from_pretrained(hf), seed=99).save_pretrained(start)
    servers = [serve(os.fspath(start), 1), serve(os.fspath(start), 1)]
    try:
        urls = {f"e{k}": s.url for k, s in enumerate(servers)}
        dirs, blocks = {}, []
        for name, swaps in JOB:
            dirs[name] = workspace / "job" / name
            dirs[name].mkdir(parents=True)
            (dirs[name] / "hf_dir").symlink_to(hf)  # the name the load-hf block reads
            text = _substituted(example(name), {k: v.format(**urls) for k, v in swaps.items()})
            blocks.append({"name": name, "code": PRELUDE.get(name, "") + text, "cwd": os.fspath(dirs[name])})
        plan = workspace / "job" / "plan.json"
        plan.write_text(json.dumps({"example": os.fspath(workspace / "ws-example"), "engines": list(urls.values()),
                                    "blocks": blocks}))
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-port", str(free_port()), os.fspath(ROOT / "tests/scripts/doc_examples.py"),
                              os.fspath(plan)], capture_output=True, text=True, timeout=900, cwd=workspace)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
        (workspace / "job" / "stdout.txt").write_text(run.stdout)
        return dirs
    finally:
        for server in servers:
            stop(server)


def _engine_holds(directory: Path, k: int, weights: Path) -> None:
    assert_logits_close(torch.load(directory / f"logits_{k}.pt"), hf_logits(os.fspath(weights), INPUT_IDS))


def test_save_and_stream_write_the_checkpoint(job, workspace):
    """example:save, example:stream-api"""
    hf = workspace / "ws-example" / "hf"
    for name in ("save", "stream-api"):  # before any training: the job's weights, bit for bit
        _assert_same_checkpoint(hf, job[name] / "out")
        assert (job[name] / "out" / "tokenizer.json").exists()
    assert " buckets, " in (workspace / "job" / "stdout.txt").read_text()


def test_live_updates_reach_the_engines(job):
    """example:stream-live, example:two-engines, example:delta: each engine holds the trained weights."""
    _engine_holds(job["stream-live"], 0, job["stream-live"] / "expected")
    for k in (0, 1):
        _engine_holds(job["two-engines"], k, job["two-engines"] / "expected")
    _engine_holds(job["delta"], 0, job["delta"] / "expected")


def test_load_then_update(job, workspace):
    """example:load-hf, example:update-weights"""
    hf = workspace / "ws-example" / "hf"
    _assert_same_checkpoint(hf, job["load-hf"] / "expected")  # trained weights replaced by the HF ones
    _engine_holds(job["update-weights"], 0, hf)


def test_fsdp_model(job, workspace):
    """example:fsdp"""
    hf = workspace / "ws-example" / "hf"
    _assert_same_checkpoint(hf, job["fsdp"] / "out")
    _engine_holds(job["fsdp"], 0, hf)
