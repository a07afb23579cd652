"""What the check that a kept plan still holds costs, part by part, on this machine: the Qwen3-30B-A3B
topology at tiny widths (48 layers x 128 experts, Megatron-Core on the CPU, one process), its plan made by a
first stream, then ``ModuleGuard.holds`` timed with the caches cold (64 MB touched before each run), and its
three parts alone: module dict sizes, parameter identities, and pointers, shapes and dtypes.

    python tools/plan_check_cost.py
"""

from __future__ import annotations

import json
import operator
import statistics
import time

import numpy as np


def job(runs: int = 15) -> dict:
    from weightstream.bench.speed import _trainer, bench_config
    from weightstream.sources.megatron import unwrap
    from weightstream.streaming.stream import stream_hf_weights

    cfg = bench_config("qwen3-30b-a3b", True, "bfloat16")
    chunks, _ = _trainer(cfg, "bfloat16")
    for _ in stream_hf_weights(chunks, cfg, bucket_bytes=256 << 10, reuse_buffers=True):
        pass
    guard = stream_hf_weights(chunks, cfg, bucket_bytes=256 << 10, reuse_buffers=True).shared.guard
    modules = [unwrap(c) for c in chunks]
    parts = {
        "holds": lambda: guard.holds(modules),
        "dict sizes": lambda: list(map(len, guard.dicts)) == guard.lengths,
        "identities": lambda: all(map(operator.is_, map(dict.get, guard.owners, guard.names), guard.tensors)),
        "pointers, shapes, dtypes": lambda: guard._meta(guard.tensors) == guard.meta,
    }
    flush = np.ones(64 << 20, dtype=np.uint8)
    out = {"parameters": len(guard.tensors), "dicts": len(guard.dicts)}
    for name, part in parts.items():
        times = []
        for _ in range(runs):
            flush += 1
            t = time.perf_counter()
            assert part()
            times.append(time.perf_counter() - t)
        out[f"{name} ms (median of {runs})"] = round(statistics.median(times) * 1e3, 2)
    return out


if __name__ == "__main__":
    from weightstream.launch import launch

    print(json.dumps(launch(1, job, backend="gloo")[0], indent=1))
