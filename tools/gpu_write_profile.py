"""On a GPU: where the device time of a stream written straight into an engine's weights goes (what an IPC update
with direct writes runs on the trainer's side), call by call: the checked piece copies (by dtype), the strided
copies, the block-FP8 casts, the checks of what no copy looked at, and the conversions made one by one; against a
device copy of the same bytes.

    PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_write_profile.py --preset qwen3-8b [--quantize fp8-block] [--no-flag]

The targets are tensors of this process (an engine's weights would be mapped here by CUDA IPC: the same memory)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from functools import partial

import torch

from weightstream.launch import launch


def _kind(call) -> str:
    from weightstream.streaming.copies import PieceCopy
    from weightstream.streaming.value_checks import PieceCheck

    if isinstance(call, PieceCopy):
        return f"piece copy ({'checked' if call.check is not None else 'plain'}, words of {call.unit} B)"
    if isinstance(call, PieceCheck):
        return "check after writes"
    if isinstance(call, partial):
        return call.func.__name__
    return type(call).__name__


def _timed_calls(calls, device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(device))
    for c in calls:
        c()
    end.record(torch.cuda.current_stream(device))
    end.synchronize()
    return start.elapsed_time(end)


def job(preset: str, quantize: bool, flag_on: bool) -> dict:
    from weightstream.bench.speed import _trainer
    from weightstream.models.presets import preset_config
    from weightstream.streaming.kept_plans import into_key
    from weightstream.streaming.stream import stream_hf_weights
    from weightstream.wire.fp8 import BlockFP8

    cfg = preset_config(preset)
    chunks, device = _trainer(cfg, "bfloat16")
    fp8 = BlockFP8() if quantize else None
    stream = stream_hf_weights(chunks, cfg, bucket_bytes=512 << 20, reuse_buffers=True, quantize=fp8)
    metas = [m for i in range(len(stream)) for m in stream.bucket_metas(i)]
    targets = {m.name: torch.empty(m.numel, dtype=m.dtype, device=device) for m in metas}
    flag = torch.zeros(1, dtype=torch.int32, device=device) if flag_on else None
    stream.write_into(targets, "profile", flag=flag)
    stream.prepare_copies()
    totals = []
    for _ in range(4):
        torch.cuda.synchronize(device)
        made = time.perf_counter()
        stream = stream_hf_weights(chunks, cfg, bucket_bytes=512 << 20, reuse_buffers=True, quantize=fp8)
        stream.write_into(targets, "profile", flag=flag)
        t = time.perf_counter()
        for _b in stream:
            pass
        host = time.perf_counter() - t
        torch.cuda.synchronize(device)
        totals.append({"make_stream_ms": (t - made) * 1e3, "host_ms": host * 1e3,
                       "total_ms": (time.perf_counter() - t) * 1e3})
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    key = into_key("profile", flag_on)
    slow = 0
    for program in stream.shared.programs.values():
        for call in program.copies.get(key, []):
            by_kind[_kind(call)] += _timed_calls([call], device)
            count[_kind(call)] += 1
        check = program.checks.get(key)
        if check is not None:
            by_kind[_kind(check)] += _timed_calls([check], device)
            count[_kind(check)] += 1
        slow += len(program.slow)
    nbytes = sum(m.nbytes for m in metas)
    part = min(nbytes, 8 << 30)  # (the copy of at most 8 GiB, scaled to the bytes: the targets fill the device)
    src = torch.empty(part, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = min(_timed_calls([lambda: dst.copy_(src)], device) for _ in range(5)) * nbytes / part
    return {"preset": preset, "quantize": quantize, "flag": flag_on, "bytes": nbytes, "tensors": len(metas),
            "slow_items": slow, "updates": totals, "calls_ms": dict(by_kind), "calls": dict(count),
            "device_copy_ms": copy_ms}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--quantize", choices=["fp8-block"], default=None)
    p.add_argument("--no-flag", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    (res,) = launch(1, job, args.preset, args.quantize is not None, not args.no_flag, backend="nccl", timeout_s=600)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
