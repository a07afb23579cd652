"""``weightstream bench --transport``: the command users run to time a path against its ceiling, here on
the CPU (gloo), small: what it reports must be what ran, and the engine must hold the trainer's weights."""

from __future__ import annotations

import math
import re

import pytest
import torch

from weightstream.bench.speed import run_bench


def test_p2p_row_runs_p2p_and_checks_the_engine():
    res = run_bench("tiny-qwen3", "p2p", dtype="float32", bucket_bytes=64 << 10, repeats=1, tp=2)
    assert res.transport == "p2p (trainer TP 2, engine TP 2)"  # no "(ran as broadcast)": P2P itself ran
    assert res.buckets > 1 and res.tensors > 0 and len(res.warm_s) == 1
    # The engine holds the embedding and lm_head whole: each trainer rank sends its vocabulary rows to both engine
    # ranks (resharded), the rest to its own; the ceiling is the plan's own sends.
    assert "sends of the resharding plan's bytes, 4 pairs of trainer and engine ranks at once" in res.ceiling
    assert math.isfinite(res.ratio) and res.ratio > 0
    diff = float(re.search(r"max \|diff\| (\S+)", res.check).group(1))
    assert diff <= 1e-4, res.check  # float32 engine vs the Megatron model's own forward
    assert res.check_ok is True and "every bucket's checksum verified by the engine" in res.check, res.check
    assert "transfer" in res.phases
    # the engine's side of the same run, split: each bucket received then loaded, the wait between requests
    assert {"receive", "load", "idle", "commit"} <= set(res.engine_phases), res.engine_phases
    assert 0 < sum(res.engine_phases.values()) < res.best_s


def test_rows_saved_with_json_print_again_from_it(tmp_path, capsys):
    """``--json`` then ``--from-json``: the rows of a run (here a CPU stream row) print again as they did,
    without running anything."""
    from weightstream.bench.speed import write_json
    from weightstream.cli import main

    res = run_bench("tiny-qwen3", "stream", dtype="float32", bucket_bytes=64 << 10, repeats=1)
    assert res.check_ok is True and res.check.startswith(f"{res.tensors} HF tensors of one more stream bit-identical")
    write_json([res, res], tmp_path / "rows.json")
    assert main(["bench", "--from-json", str(tmp_path / "rows.json")]) == 0
    assert capsys.readouterr().out == (res.render() + "\n") * 2


def test_a_moe_row_checks_the_engine_with_the_megatron_models_own_forward():
    """The MoE router runs without Transformer Engine (its GEMM name unbound otherwise, on any device), so a MoE
    row's check compares logits rather than reporting that it could not."""
    res = run_bench("tiny-qwen3-moe", "broadcast", dtype="float32", bucket_bytes=64 << 10, repeats=1)
    assert res.check_ok is True, res.check
    assert float(re.search(r"max \|diff\| (\S+)", res.check).group(1)) <= 1e-4


def test_an_fp8_ipc_row_writes_into_the_float8_engine_and_checks_it():
    """``--quantize fp8-block`` on an update row: the engine starts on the model's block-FP8 config (holding float8
    values and scales), the colocated trainer quantizes straight into them (one copy), and the row's check verifies
    every bucket's checksum and the engine's logits against the Megatron model's own forward with the weights the
    engine serves (each FP8 tensor fp8 × scale), to float32 rounding."""
    from weightstream.wire.fp8 import BlockFP8

    res = run_bench("tiny-qwen3", "ipc", dtype="float32", bucket_bytes=64 << 10, repeats=1,
                    quantize=BlockFP8((16, 16)))
    assert res.transport == "ipc (block FP8 16x16) (one copy: written into the engine's weights)", res.transport
    assert res.check_ok is True and "every bucket's checksum verified by the engine" in res.check, res.check
    assert res.ceiling == "device copy of the bf16 bytes read"
    # the engine's side: the channel and the offer, the backup of what the trainer overwrites, then its writes
    assert {"handshake", "backup", "wait", "commit"} <= set(res.engine_phases), res.engine_phases
    assert "load" not in res.engine_phases  # written by the trainer: nothing loaded by the engine
    diff = float(re.search(r"max \|diff\| (\S+)", res.check).group(1))
    assert diff <= 1e-4, res.check


@pytest.mark.parametrize("optimizer", [[], ["--optimizer-on-host"]], ids=["adam-on-device", "adam-on-host"])
def test_delta_row_on_real_adam_steps(tmp_path, capsys, optimizer):
    """``bench --delta``: the first update full, ``repeats`` forced full ones of the same weights, then per learning
    rate real Adam steps (Megatron's own loss, backward, fp32 masters) each followed by a delta update: every update
    checked by the engine's checksums, fewer words changed at the smaller rate, the bytes on the wire those of the
    encodings, and the engine's logits the Megatron model's after the last. Printed and saved as JSON. The same with
    Adam's states kept in host memory, each parameter stepped in turn (``--optimizer-on-host``)."""
    import json

    from weightstream.cli import main

    argv = ["bench", "--delta", "--transport", "broadcast", "--preset", "tiny-qwen3", "--bucket-mb", "0.125",
            "--lr", "1e-6,1e-4", "--steps", "2", "--repeats", "1", "--json", str(tmp_path / "d.json"), *optimizer]
    assert main(argv) == 0
    out = capsys.readouterr().out
    (row,) = json.loads((tmp_path / "d.json").read_text())
    updates = row["updates"]
    assert [(u["lr"], u["full"]) for u in updates] == [(None, True)] * 2 + [(1e-6, False)] * 2 + [(1e-4, False)] * 2
    assert updates[1]["reason"] == "a full update of the same weights, timed to compare with"
    assert all(u["checked"] for u in updates) and row["check"].startswith("6 of 6 updates checked")
    small, large = (max(u["changed_fraction"] for u in updates[2:4]), min(u["changed_fraction"] for u in updates[4:]))
    assert 0 < small < large < 1
    assert all(u["wire_bytes"] < row["bytes"] for u in updates[2:]) and updates[0]["wire_bytes"] == row["bytes"]
    assert row["snapshot_bytes"] == row["bytes"]
    assert float(re.search(r"max \|diff\| (\S+)", row["check"]).group(1)) <= 0.1 and row["check_ok"] is True
    assert "lr 1e-06 step 2:" in out and "check (passed)" in out
    assert row["optimizer"] == ("host" if optimizer else "device")
    assert f"Adam's states on the {row['optimizer']}" in out
    # tools/multinode_model.py --check takes the row: per learning rate, its best delta update on the row's link
    model = _multinode_model()
    checked = model.check_rows([str(tmp_path / "d.json")], model.H100, model.fit())
    assert [(r["update"], r["measured_ms"]) for r in checked] == [
        (f"delta, lr {lr:g}", min(u["seconds"] for u in updates if u["lr"] == lr) * 1e3) for lr in (1e-6, 1e-4)]


@pytest.mark.unit
def test_adam_states_on_the_host_step_as_one_adam_over_all():
    """Adam's states kept per parameter and stepped one parameter at a time (``optimizer="host"``) give the
    masters and the model's parameters of one Adam over every parameter, bit for bit (on the CPU both take torch's
    single-tensor Adam), step after step."""
    from torch import nn

    from weightstream.bench.delta import _Adam

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))

    chunks = {"device": [model()], "host": [model()]}
    adams = {where: _Adam(chunks[where], "device", 1e-2, states=where) for where in chunks}
    for step in range(3):
        for where, adam in adams.items():
            for k, p in enumerate(adam.params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + k))
            with torch.no_grad():
                (adam._step_each if where == "host" else adam._step_all)()
        for a, b in zip(adams["device"].masters, adams["host"].masters, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(chunks["device"][0].parameters(), chunks["host"][0].parameters(), strict=True):
            assert torch.equal(a, b) and a.grad is None and b.grad is None
    assert len(adams["host"].opts) == 4 and len(adams["device"].opts) == 1


def _multinode_model():
    """tools/multinode_model.py as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "multinode_model.py"
    spec = importlib.util.spec_from_file_location("multinode_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["multinode_model"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _environment(names: list[str]) -> dict[str, str | None]:
    import os

    return {n: os.environ.get(n) for n in names}


def test_a_socket_wire_row_is_refused_on_gloo_and_its_environment_reaches_every_process(monkeypatch):
    """``--wire socket`` runs NCCL on its socket transport over loopback: without a CUDA device (gloo) a row is
    refused before anything runs, with every problem in one error, by ``run_bench``, ``run_delta_bench`` and the
    command. The settings it gives every process of a row reach a launched rank, and are undone after."""
    import os

    from weightstream.bench.delta import run_delta_bench
    from weightstream.bench.speed import SOCKET_WIRE, on_wire
    from weightstream.cli import main
    from weightstream.launch import launch

    gloo = ("--wire socket runs NCCL on its socket transport over loopback: NCCL only, and without a CUDA device "
            "the bench runs gloo")
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(ValueError) as e:
        run_bench("tiny-qwen3", "broadcast", wire="socket")
    assert str(e.value) == f"bench: {gloo}"
    with pytest.raises(ValueError) as e:
        run_bench("tiny-qwen3", "ipc", wire="socket")
    assert str(e.value) == ("bench: --wire socket times a transfer between devices (broadcast, p2p), not "
                            f"--transport ipc; {gloo}")
    with pytest.raises(ValueError) as e:
        run_delta_bench("tiny-qwen3", "broadcast", wire="socket")
    assert str(e.value) == f"bench --delta: {gloo}"
    assert main(["bench", "--transport", "broadcast,p2p", "--wire", "socket"]) == 2
    names = sorted(SOCKET_WIRE)
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NET", "IB")  # one set before: it comes back after
    with on_wire("socket"):
        (seen,) = launch(1, _environment, names, backend="gloo")
    assert seen == SOCKET_WIRE
    assert _environment(names) == {n: ("IB" if n == "NCCL_NET" else None) for n in names}
    assert os.environ["NCCL_NET"] == "IB"


def test_the_multinode_model_checked_against_a_broadcast_rows_json(tmp_path, capsys):
    """``tools/multinode_model.py --check F.json``: a broadcast row of ``bench --json`` modelled on its own link
    (the rate of its ceiling, a plain broadcast of the same bytes in the same run), the model's time and the
    measured one side by side. Here a CPU row (gloo, the link the machine's memory): only the arithmetic is checked,
    not the model's calibration (fitted on GPUs)."""
    import json

    from weightstream.bench.speed import write_json

    model = _multinode_model()
    res = run_bench("tiny-qwen3", "broadcast", dtype="bfloat16", bucket_bytes=64 << 10, repeats=1)
    write_json([res], tmp_path / "rows.json")
    model.main(["--check", str(tmp_path / "rows.json"), "--json", str(tmp_path / "check.json")])
    (row,) = json.loads((tmp_path / "check.json").read_text())
    link = res.bytes / res.ceiling_s / 1e9
    assert row["link_gbps"] == round(link, 3) and row["measured_ms"] == res.best_s * 1e3
    want = model.on_link("tiny-qwen3", "bf16", res.buckets, link, model.H100, model.fit())
    assert row["model_ms"] == round(want.ms, 1) and row["bound"] == want.bound
    assert model.model_bytes("tiny-qwen3").total("bf16") == res.bytes  # the model's bytes are the row's
    out = capsys.readouterr().out
    assert f"| tiny-qwen3 full update (bf16) | default | {link:.2f} GB/s |" in out
