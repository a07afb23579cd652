"""Trainers started the way users start them — ``torchrun`` (whose workers see
``TORCHELASTIC_USE_AGENT_STORE``) and a plain single process — update a running reference engine by
broadcast, by P2P and by IPC (its control channel per TP rank); the engine's logits equal the HF model's after
each update."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.workers import INPUT_IDS
from tests.test_update import engine
from weightstream.launch import free_port
from weightstream.models.presets import preset_config, save_random_checkpoint

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_and_update.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], timeout: float = 400) -> None:
    # Output goes to a file, not a pipe: on the CPU, IPC shares buffers through torch's shared-memory manager,
    # a process the trainer starts that lives while the engine's workers (its clients) do; it would hold a
    # pipe open after the trainer exited.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        log.seek(0)
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{log.read()[-12000:]}"


def _check(src: str, out, transport: str, torchrun: bool) -> None:
    import torch

    reports = json.loads((out / "reports.json").read_text())
    assert [r["transport"] for r in reports] == [transport, transport], reports
    if transport == "ipc":  # the reference engine takes the metadata ahead, with a control channel per rank
        assert all(r["ahead"] for r in reports), reports
    assert [r["version"] for r in reports] == ["step-0", "step-1"]
    assert all(r["launcher_env"] == torchrun for r in reports)  # the variable that broke group formation was set
    first, second = torch.load(out / "logits0.pt"), torch.load(out / "logits1.pt")
    assert_logits_close(first, hf_logits(src, INPUT_IDS))
    assert_logits_close(second, hf_logits(str(out / "step1"), INPUT_IDS))
    assert (second - first).abs().max() > 1e-2


# Broadcast into an engine at TP 1, and IPC and P2P into one at TP 2, run under torchrun in
# test_torchrun_trainer_sends_deltas (a full update, then a delta); full updates by each transport are
# launch()'s tests' (tests/test_update.py).
@pytest.mark.parametrize("transport,engine_tp", [("p2p", 1), ("ipc", 1)])
def test_torchrun_trainer_updates_engine(tmp_path, transport, engine_tp):
    """``ipc`` into an engine at TP 1: trainer rank 0 writes every tensor (those gathered over TP included)
    straight into the engine's weights. ``p2p`` into an engine at TP 1: resharded, both trainer ranks sending
    their shards to the engine's one rank."""
    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=31)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=32)
    out = tmp_path / "out"
    out.mkdir()
    with engine(eng_dir, tp=engine_tp) as server:
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
              SCRIPT, "--src", src, "--engine", server.url, "--transport", transport, "--tp", "2", "--out", str(out)])
    _check(src, out, transport, torchrun=True)
    if transport == "ipc":
        reports = json.loads((out / "reports.json").read_text())
        assert [r["direct"] for r in reports] == [engine_tp == 1] * 2, reports


def test_torchrun_trainer_updates_an_fp8_engine(tmp_path):
    """Block FP8 from a torchrun job (TP 2, P2P) into an FP8 engine: after the second update its logits equal, bit
    for bit, those of an engine started on the FP8 checkpoint the job wrote of the same weights."""
    import torch

    from tests.test_fp8_engine import _fp8_checkpoint
    from weightstream.engines import ReferenceEngine

    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=35)
    start = _fp8_checkpoint("tiny-qwen3", tmp_path / "start", seed=36)["fp8"]
    out = tmp_path / "out"
    out.mkdir()
    with engine(start, tp=2) as server:
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
              SCRIPT, "--src", src, "--engine", server.url, "--transport", "p2p", "--tp", "2", "--out", str(out),
              "--fp8-block", "16"])
    reports = json.loads((out / "reports.json").read_text())
    assert [r["transport"] for r in reports] == ["p2p", "p2p"] and all(r["launcher_env"] for r in reports)
    with engine(str(out / "step1"), tp=2) as ref:
        assert torch.equal(torch.load(out / "logits1.pt"), ReferenceEngine(ref.url).logits(INPUT_IDS))


@pytest.mark.parametrize("transport,engine_tp", [("broadcast", 1), ("ipc", 2), ("p2p", 2)])
def test_torchrun_trainer_sends_deltas(tmp_path, transport, engine_tp):
    """Delta updates from a torchrun job (TP 2; broadcast into an engine at TP 1, or colocated IPC and P2P into one at
    TP 2, each trainer rank encoding against its own snapshot), one WeightSync for both: the first full, the second
    the words that changed, each checked by the engine's checksums; the engine's logits equal HF's after each (the
    second: the checkpoint of the changed weights)."""
    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=37)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=38)
    out = tmp_path / "out"
    out.mkdir()
    with engine(eng_dir, tp=engine_tp) as server:
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
              SCRIPT, "--src", src, "--engine", server.url, "--transport", transport, "--tp", "2", "--out", str(out),
              "--delta"])
    _check(src, out, transport, torchrun=True)
    assert all(r["ahead"] for r in json.loads((out / "reports.json").read_text()))  # headers on the wire
    first, second = (r["delta"] for r in json.loads((out / "reports.json").read_text()))
    assert (first["full"], first["reason"], first["checked"]) == (True, "the first update", True), first
    assert (second["full"], second["reason"], second["checked"]) == (False, "deltas against version step-0", True)
    assert second["changed"] > 0
    if transport == "ipc":  # at TP 2 each trainer rank's buckets cross its control channel, none written directly
        assert [r["direct"] for r in json.loads((out / "reports.json").read_text())] == [False, False]


def test_torchrun_trainer_of_two_replicas_updates_two_engines_by_p2p(tmp_path):
    """A torchrun job of two data-parallel replicas (TP 1) into two engines by P2P, with deltas: engine j gets its
    buckets from replica j (each replica's rank encoding against its own snapshot, each engine checked against
    it); both engines' logits equal HF's after each update."""
    import torch

    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=39)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=40)
    out = tmp_path / "out"
    out.mkdir()
    with engine(eng_dir) as one, engine(eng_dir) as two:
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
              SCRIPT, "--src", src, "--engine", one.url, "--engine", two.url, "--transport", "p2p", "--out", str(out),
              "--delta"])
    _check(src, out, "p2p", torchrun=True)
    reports = json.loads((out / "reports.json").read_text())
    assert all(r["reason"].startswith("2 engines at the trainer's TP 1") for r in reports), reports
    assert [(r["delta"]["full"], r["delta"]["checked"]) for r in reports] == [(True, True), (False, True)], reports
    assert all(r["ahead"] for r in reports)  # each delta's header on the wire, no request per bucket
    for step, ref in ((0, src), (1, str(out / "step1"))):
        assert_logits_close(torch.load(out / f"logits{step}_1.pt"), hf_logits(ref, INPUT_IDS))


def test_torchrun_moe_trainer_into_an_engine_with_expert_parallelism(tmp_path):
    """A torchrun job training Qwen3-MoE at EP 2 into an engine at TP 2 with expert parallelism, by resharded P2P
    with deltas: each trainer rank sends each engine rank only the experts it owns; the engine's logits equal HF's
    after each update."""
    cfg = preset_config("tiny-qwen3-moe")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=41)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=42)
    out = tmp_path / "out"
    out.mkdir()
    with engine(eng_dir, tp=2, ep=2) as server:
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
              SCRIPT, "--src", src, "--engine", server.url, "--transport", "p2p", "--ep", "2", "--out", str(out),
              "--delta"])
    _check(src, out, "p2p", torchrun=True)
    reports = json.loads((out / "reports.json").read_text())
    assert all("engine TP 2 EP 2" in r["reason"] and "resharded P2P" in r["reason"] for r in reports), reports
    assert [(r["delta"]["full"], r["delta"]["checked"]) for r in reports] == [(True, True), (False, True)], reports
    assert all(r["ahead"] for r in reports)


def test_plain_single_process_trainer(tmp_path):
    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=33)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=34)
    out = tmp_path / "out"
    out.mkdir()
    with engine(eng_dir, tp=1) as server:
        _run([sys.executable, SCRIPT, "--src", src, "--engine", server.url, "--transport", "broadcast",
              "--out", str(out)])
    _check(src, out, "broadcast", torchrun=False)
