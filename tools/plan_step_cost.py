"""What an update's plan step costs on this machine once its plan is kept: the Qwen3-8B topology at tiny widths
(399 tensors, Megatron-Core on the CPU, one process), timed as ``WeightSync`` takes it (the config's spec and the
model's source made once, then ``stream_of``) and as a plain caller of ``stream_hf_weights`` on the same job (which
makes the spec and the source again). Median of ``--runs`` rounds of 200 calls each, in microseconds.

    python tools/plan_step_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _per_call_us(fn, calls: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def job(runs: int) -> dict:
    import torch.distributed as dist

    from weightstream.bench.speed import _trainer, bench_config
    from weightstream.streaming.kept_plans import PlanSettings
    from weightstream.streaming.stream import DEFAULT_BUCKET_BYTES, confirm_plan, stream_hf_weights, stream_of
    from weightstream.update.sync import _Job

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = bench_config("qwen3-8b", True, "bfloat16")
    chunks, _ = _trainer(cfg, "bfloat16")
    settings = PlanSettings("full", DEFAULT_BUCKET_BYTES, 256, False, None)

    def as_weight_sync():
        j = _Job.of(chunks, cfg)
        return stream_of(j.source, j.cfg, j.spec, settings, reuse_buffers=True, confirm_later=True)

    def as_plain_caller():
        j = _Job.of(chunks, cfg)
        return stream_hf_weights(j.source, j.cfg, reuse_buffers=True, confirm_later=True)

    for _ in range(3):  # the plan made and kept, then reused
        stream = as_weight_sync()
        for _bucket in stream:
            pass
        confirm_plan(stream)
    out = {"hf_tensors": stream.stats.tensors}
    for name, fn in (("weight_sync_us", as_weight_sync), ("plain_caller_us", as_plain_caller)):
        out[name] = round(statistics.median(_per_call_us(fn) for _ in range(runs)), 1)
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    print(json.dumps(job(parser.parse_args().runs)))


if __name__ == "__main__":
    main()
