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
    assert "send/recv of each rank's bytes, 2 pairs at once" in res.ceiling
    assert math.isfinite(res.ratio) and res.ratio > 0
    diff = float(re.search(r"max \|diff\| (\S+)", res.check).group(1))
    assert diff <= 1e-4, res.check  # float32 engine vs the Megatron model's own forward
    assert "transfer" in res.phases
