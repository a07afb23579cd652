"""``weightstream dump`` with expert parallelism, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

from weightstream.models.presets import preset_config, save_random_checkpoint


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_dump_with_ep_and_expert_tp_then_verify(tmp_path):
    src = save_random_checkpoint(preset_config("tiny-qwen2-moe"), tmp_path / "src", seed=5)
    out = tmp_path / "dump"
    # TP 2 x EP 2 with expert-TP 1 (experts whole, dense layers split): 2 processes.
    res = run("dump", "--hf", src, "--tp", "2", "--ep", "2", "--etp", "1", "--bucket-mb", "0.05", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "TP 2 × PP 1 × EP 2" in res.stderr and "129 tensors" in res.stdout
    res = run("verify", src, str(out))
    assert res.returncode == 0 and "identical: 129 tensors compared" in res.stdout, res.stdout


def test_ep_options_are_checked_against_the_model(tmp_path):
    res = run("dump", "--preset", "tiny-qwen3", "--ep", "2", "--etp", "2", "--out", str(tmp_path / "x"))
    assert res.returncode != 0 and "--ep / --etp need a mixture-of-experts model; qwen3 has no experts" in res.stderr
    res = run("dump", "--preset", "tiny-qwen3-moe", "--ep", "3", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and res.stderr == (
        "error: qwen3_moe cannot be laid out as asked: --ep 3 does not divide the 8 experts\n")
    assert not (tmp_path / "x").exists()
