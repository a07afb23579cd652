"""``weightstream bench --transport``: the command users run to time a path against its ceiling, here on
the CPU (gloo), small: what it reports must be what ran, and the engine must hold the trainer's weights."""

from __future__ import annotations

import math
import re

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
    from weightstream.converters.fp8 import BlockFP8

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


def test_delta_row_on_real_adam_steps(tmp_path, capsys):
    """``bench --delta``: the first update full, ``repeats`` forced full ones of the same weights, then per learning
    rate real Adam steps (Megatron's own loss, backward, fp32 masters) each followed by a delta update: every update
    checked by the engine's checksums, fewer words changed at the smaller rate, the bytes on the wire those of the
    encodings, and the engine's logits the Megatron model's after the last. Printed and saved as JSON."""
    import json

    from weightstream.cli import main

    argv = ["bench", "--delta", "--transport", "broadcast", "--preset", "tiny-qwen3", "--bucket-mb", "0.125",
            "--lr", "1e-6,1e-4", "--steps", "2", "--repeats", "1", "--json", str(tmp_path / "d.json")]
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
