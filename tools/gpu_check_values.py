"""On a GPU: the one-launch value check (weightstream.receiver.value_kernel) against the torch path, report for report,
then the time each takes per bucket of a Qwen3-30B-A3B's shapes (bf16, and block FP8 with its scales); and the
checked copies that write straight into an engine's weights (weightstream.streaming.copies.PieceCopy with a WordCheck,
the rest by weightstream.streaming.value_checks.PieceCheck) against the torch path, and against a plain copy in time.

    PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_check_values.py --trials 300 --json "$OUT/check_values.json"

Every trial lays out a bucket of random tensors (bf16, fp16, fp32, float8 e4m3 weights each followed by its float32
scales, e5m2, an int64 index), fills it with finite values and positive scales, and puts 0-2 faults in it: NaN or
an infinity in a weight of each float dtype, a NaN byte of e4m3, a scale that is negative, zero, NaN or above the
bound, or NaN in the padding between two tensors. The kernel's report (its flag, then the torch path naming what
is wrong) must equal the torch path's own, tensor for tensor; a trial whose reports differ fails the run.

Every checked-copy trial copies random tensors of every float dtype (faults put in as above, at offsets that make
the copies' words 1, 2, 4 or 8 bytes wide) into targets as a trainer writes an engine's weights: each dtype's
copies in one checked launch, scales looked at after. The targets must equal the sources bit for bit, and the flag
must be raised exactly where the torch path finds something wrong in the targets."""

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
from weightstream.streaming import copies, value_checks
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


def _copy_trial(rng: random.Random, device: torch.device) -> tuple[list[str], bool, bool, bool]:
    """One checked-copy trial: (the faults put in, targets equal to sources, flag raised, torch path found any)."""
    tensors = _layout(rng)
    src_raw, _, entries = _bucket(tensors, rng, device)
    what = [_fault(src_raw, None, entries, rng) for _ in range(rng.choice((0, 1, 1, 2)))]
    shift = rng.choice((0, 1, 2, 4))  # the targets' base: words of 1, 2, 4 or 8 bytes
    dst_raw = torch.zeros(src_raw.numel() + 16, dtype=torch.uint8, device=device)[8 + shift:8 + shift + src_raw.numel()]
    dst_raw.fill_(0x55)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    groups: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    after: list[tuple[str, torch.Tensor]] = []
    named = []
    for dtype, offset, numel, (name, _) in entries:
        if dtype.is_floating_point and offset % dtype.itemsize == 0 and (offset + shift) % dtype.itemsize == 0:
            s_view = src_raw.narrow(0, offset, numel * dtype.itemsize).view(dtype)
            d_view = dst_raw.narrow(0, offset, numel * dtype.itemsize).view(dtype)
            named.append((name, d_view))
            kind = value_checks.kind_of(dtype, name)
            if kind == value_checks.SCALE:
                d_view.copy_(s_view)
                after.append((name, d_view))
            else:
                groups.setdefault(dtype, []).append((d_view, s_view))
    for dtype, pairs in groups.items():
        copies.PieceCopy([d for d, _ in pairs], [s for _, s in pairs],
                         copies.WordCheck(value_checks.KINDS[dtype], flag))()
    pieces = value_checks.tensor_pieces(after)
    if pieces:
        value_checks.PieceCheck(pieces, flag)()
    equal = all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for pairs in groups.values() for d, s in pairs)
    expected = check_values(named)
    return what, equal, bool(flag), bool(expected.bad_scales or expected.nonfinite)


def checked_copies(trials: int, device: torch.device) -> dict:
    rng = random.Random(11)
    failures, faults, flagged = [], 0, 0
    for trial in range(trials):
        what, equal, raised, found = _copy_trial(rng, device)
        faults += sum(w != "none" for w in what)
        flagged += int(raised)
        if not equal or raised != found:
            failures.append({"trial": trial, "faults": what, "equal": equal, "flag": raised, "torch": found})
    return {"trials": trials, "faults": faults, "flagged": flagged, "failures": failures}


def copy_speed(device: torch.device) -> dict:
    """A 492 MiB bucket of a Qwen3-30B-A3B layer's bf16 experts, copied tensor by tensor into other tensors: one
    plain piece-copy launch, one checked launch, and a device copy of the same bytes."""
    shapes = [n for _, _, n in _shapes_30b(False)]
    src = [torch.randn(n, device=device).to(torch.bfloat16) for n in shapes]
    dst = [torch.empty_like(t) for t in src]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    plain = copies.PieceCopy(dst, src)
    checked = copies.PieceCopy(dst, src, copies.WordCheck(value_checks.KINDS[torch.bfloat16], flag))
    whole, whole_dst = torch.cat(src), torch.empty(sum(shapes), dtype=torch.bfloat16, device=device)
    row = {"bytes": sum(shapes) * 2, "tensors": len(shapes), "plain piece copy": _time(plain, device),
           "checked piece copy": _time(checked, device), "device copy": _time(lambda: whole_dst.copy_(whole), device)}
    print(f"copies: {row['tensors']} tensors, {row['bytes'] / 2**20:.0f} MiB; (host ms, elapsed ms) "
          + "; ".join(f"{k} {v[0]:.3f}, {v[1]:.3f}" for k, v in row.items() if isinstance(v, tuple)))
    return row


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
              "checked copies": checked_copies(args.trials, device), "copy speed": copy_speed(device),
              "gpu": torch.cuda.get_device_name(device)}
    c, k = result["correctness"], result["checked copies"]
    print(f"correctness: {c['trials']} buckets, {c['faults']} faults put in, {c['flagged']} flagged, "
          f"{len(c['failures'])} reports differing from the torch path's")
    for f in c["failures"][:5]:
        print("  ", f)
    print(f"checked copies: {k['trials']} trials, {k['faults']} faults put in, {k['flagged']} flagged, "
          f"{len(k['failures'])} differing from the torch path's (or not copied bit for bit)")
    for f in k["failures"][:5]:
        print("  ", f)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if not c["failures"] and not k["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
