"""On a GPU: the one-launch value check (weightstream.receiver.value_kernel) against the torch path, report for report,
then the time each takes per bucket of a Qwen3-30B-A3B's shapes (bf16, and block FP8 with its scales).

    PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_check_values.py --trials 300 --json "$OUT/check_values.json"

Every trial lays out a bucket of random tensors (bf16, fp16, fp32, float8 e4m3 weights each followed by its float32
scales, e5m2, an int64 index), fills it with finite values and positive scales, and puts 0-2 faults in it: NaN or
an infinity in a weight of each float dtype, a NaN byte of e4m3, a scale that is negative, zero, NaN or above the
bound, or NaN in the padding between two tensors. The kernel's report (its flag, then the torch path naming what
is wrong) must equal the torch path's own, tensor for tensor; a trial whose reports differ fails the run."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from weightstream.receiver import value_kernel
from weightstream.receiver.values import check_runs, check_values
from weightstream.streaming.bucket import typed_buffer, typed_runs, typed_views
from weightstream.wire.fp8 import SCALE_SUFFIX

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e5m2)


def _layout(rng: random.Random) -> list[tuple[str, torch.dtype, int]]:
    out: list[tuple[str, torch.dtype, int]] = []
    for i in range(rng.randint(1, 24)):
        pick = rng.random()
        if pick < 0.4:  # a block-FP8 weight and its scales
            out.append((f"l{i}.weight", torch.float8_e4m3fn, rng.randint(1, 5000)))
            out.append((f"l{i}.weight" + SCALE_SUFFIX, torch.float32, rng.randint(1, 40)))
        elif pick < 0.95:
            out.append((f"w{i}.weight", rng.choice(FLOATS), rng.randint(1, 5000)))
        else:
            out.append((f"i{i}.index", torch.int64, rng.randint(1, 50)))
    return out


def _bucket(tensors, rng: random.Random, device: torch.device):
    entries, offset = [], 0
    for name, dtype, numel in tensors:
        offset = -(-offset // 16) * 16 + 16 * rng.randint(0, 1)  # padding between some tensors
        entries.append((dtype, offset, numel, (name, None)))
        offset += numel * dtype.itemsize
    raw = typed_buffer(offset, device)
    raw.zero_()
    runs = typed_runs(entries)
    for dtype, sizes, payload in runs:
        for (name, _), view in zip(payload, typed_views(raw, dtype, sizes), strict=True):
            if name.endswith(SCALE_SUFFIX):
                view.copy_(torch.rand(view.numel(), device=device) * 100 + 1e-3)
            elif dtype.is_floating_point:
                view.copy_((torch.randn(view.numel(), device=device) * 4).to(dtype))
            else:
                view.copy_(torch.randint(0, 9, (view.numel(),), device=device))
    return raw, runs, entries


BAD_WEIGHT = {torch.bfloat16: (0x7FC0, 0x7F80, 0xFF80), torch.float16: (0x7E00, 0x7C00, 0xFC00),
              torch.float32: (0x7FC00000, 0x7F800000, 0xFF800000), torch.float8_e5m2: (0x7F, 0x7C, 0xFC),
              torch.float8_e4m3fn: (0x7F, 0xFF)}
BAD_SCALE = (-1.0, 0.0, -0.0, float("nan"), float("inf"), 2.0**33)
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _fault(raw, runs, entries, rng: random.Random) -> str:
    dtype, offset, numel, (name, _) = rng.choice(entries)
    at = rng.randrange(numel)
    if name.endswith(SCALE_SUFFIX):
        value = rng.choice(BAD_SCALE)
        raw.narrow(0, offset, numel * 4).view(torch.float32)[at] = value
        return f"scale {name}[{at}] = {value}"
    if dtype in BAD_WEIGHT:
        bits = rng.choice(BAD_WEIGHT[dtype])
        word = INT_VIEW[dtype.itemsize]
        signed = bits - (1 << (8 * dtype.itemsize)) if bits >= 1 << (8 * dtype.itemsize - 1) else bits
        raw.narrow(0, offset, numel * dtype.itemsize).view(word)[at] = signed if word != torch.uint8 else bits
        return f"{name}[{at}] bits {bits:#x}"
    gap = offset - 2
    if gap >= 0 and all(not (o <= gap < o + n * d.itemsize) for d, o, n, _ in entries):
        raw[gap:gap + 2].view(torch.int16)[0] = 0x7FC0  # NaN as bf16 in padding
        return f"padding at byte {gap}"
    return "none"


def correctness(trials: int, device: torch.device) -> dict:
    rng = random.Random(7)
    failures, faults, flagged = [], 0, 0
    for trial in range(trials):
        raw, runs, entries = _bucket(_layout(rng), rng, device)
        what = [_fault(raw, runs, entries, rng) for _ in range(rng.choice((0, 1, 1, 2)))]
        faults += sum(w != "none" for w in what)
        views = [(n, v) for dtype, sizes, payload in runs
                 for (n, _), v in zip(payload, typed_views(raw, dtype, sizes), strict=True)]
        expected = check_values(views)
        got = check_runs(raw, runs)
        flag = value_kernel.bucket_flag(raw, runs) if value_kernel.available(device) else None
        flagged += int(flag is not None and bool(flag))
        if got != expected or (flag is not None and (expected.bad_scales or expected.nonfinite) and not bool(flag)):
            failures.append({"trial": trial, "faults": what, "expected": str(expected), "got": str(got)})
    return {"trials": trials, "faults": faults, "flagged": flagged, "failures": failures}


def _shapes_30b(fp8: bool) -> list[tuple[str, torch.dtype, int]]:
    """One 512 MiB bucket of a Qwen3-30B-A3B layer's experts (768 x 2048 projections), bf16 or block FP8."""
    out: list[tuple[str, torch.dtype, int]] = []
    for e in range(328 if fp8 else 164):
        name = f"model.layers.0.mlp.experts.{e // 3}.{('gate', 'up', 'down')[e % 3]}_proj.weight"
        if fp8:
            out += [(name, torch.float8_e4m3fn, 768 * 2048), (name + SCALE_SUFFIX, torch.float32, 6 * 16)]
        else:
            out.append((name, torch.bfloat16, 768 * 2048))
    return out


def _time(fn, device: torch.device, repeats: int = 20) -> tuple[float, float]:
    """(host ms per call, elapsed ms per call with the device finished)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    host = 0.0
    start = time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        host += time.perf_counter() - t
    torch.cuda.synchronize(device)
    return host / repeats * 1e3, (time.perf_counter() - start) / repeats * 1e3


def _speed_row(fp8: bool, device: torch.device) -> dict:
    raw, runs, _ = _bucket(_shapes_30b(fp8), random.Random(1), device)
    views = [(n, v) for dtype, sizes, payload in runs
             for (n, _), v in zip(payload, typed_views(raw, dtype, sizes), strict=True)]
    row: dict = {"bucket": "block FP8" if fp8 else "bf16", "bytes": raw.numel(),
                 "tensors": sum(len(p) for _, _, p in runs)}
    row["kernel"] = _time(lambda: check_runs(raw, runs), device)
    os.environ["WEIGHTSTREAM_CHECK_KERNEL"] = "0"
    row["torch, per stretch"] = _time(lambda: check_runs(raw, runs), device)
    row["torch, per tensor"] = _time(lambda: check_values(views), device)
    os.environ.pop("WEIGHTSTREAM_CHECK_KERNEL")
    copy = raw.clone()
    row["device copy of the bucket"] = _time(lambda: copy.copy_(raw), device)
    print(f"{row['bucket']}: {row['tensors']} tensors, {row['bytes'] / 2**20:.0f} MiB; (host ms, elapsed ms) "
          + "; ".join(f"{k} {v[0]:.3f}, {v[1]:.3f}" for k, v in row.items() if isinstance(v, tuple)))
    return row


def speed(device: torch.device) -> list[dict]:
    return [_speed_row(fp8, device) for fp8 in (False, True)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=300)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    if not value_kernel.available(device):
        print("the value kernel is not available here (no CUDA device or no Triton)")
        return 1
    result = {"correctness": correctness(args.trials, device), "speed": speed(device),
              "gpu": torch.cuda.get_device_name(device)}
    c = result["correctness"]
    print(f"correctness: {c['trials']} buckets, {c['faults']} faults put in, {c['flagged']} flagged, "
          f"{len(c['failures'])} reports differing from the torch path's")
    for f in c["failures"][:5]:
        print("  ", f)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if not c["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
