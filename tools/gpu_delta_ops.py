"""Where a delta update's time goes on the GPU, per 512 MiB bucket of bf16 words: each step of encoding (the
comparison, the count, the values, the positions or the bitmap), applying, the checksum both sides compute,
and a device copy of the same bytes for scale. Every payload is applied back and compared bit for bit.

``python tools/gpu_delta_ops.py [--mib 512] [--changed 0.05 0.22]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from check_word_kernels import torch_path

from weightstream.common import word_kernels
from weightstream.streaming.delta import _count, _pack_bits, apply, encode, encode_into
from weightstream.wire.handles import checksum


def _ms(fn: Callable[[], object], runs: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--changed", type=float, nargs="+", default=[0.05, 0.22])
    args = ap.parse_args()
    n = (args.mib << 20) // 2
    dev = torch.device("cuda")
    old = torch.randn(n, device=dev).to(torch.bfloat16)
    print(f"bucket {args.mib} MiB ({n} bf16 words)")
    copy, digest = _ms(lambda: old.clone()), _ms(lambda: checksum(old.view(torch.uint8)))
    with torch_path():
        torch_digest = _ms(lambda: checksum(old.view(torch.uint8)))
    print(f"  device copy {copy:.2f} ms; checksum {digest:.2f} ms (word kernels: "
          f"{word_kernels.available(dev)}; torch operations {torch_digest:.2f} ms)")
    for frac in args.changed:
        new = old.clone()
        where = torch.rand(n, device=dev) < frac
        new[where] = (new[where].float() * 1.001 + 1e-3).to(torch.bfloat16)
        times = _measure(new, old)
        print(f"  {frac:.0%} changed: " + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))


def _measure(new: torch.Tensor, old: torch.Tensor) -> dict[str, float]:
    """Each step of encoding ``new`` against ``old`` (bf16), then each encoding and its application, timed."""
    a, b = new.view(torch.int16), old.view(torch.int16)
    mask = a != b
    parts = {
        "compare": lambda: a != b,
        "count (.item)": lambda: int(mask.sum().item()),
        "values a[mask]": lambda: a[mask],
        "positions nonzero": lambda: mask.nonzero(),
        "bitmap _pack_bits": lambda: _pack_bits(mask),
        # the alternatives measured against them
        "count_nonzero (.item)": lambda: int(torch.count_nonzero(mask).item()),
        "count 8 at a time (_count)": lambda: _count(mask),
        "values masked_select": lambda: torch.masked_select(a, mask),
        "scatter index_put": lambda: b.clone().index_put_((mask,), a[mask]),
        "scatter masked_scatter": lambda: b.clone().masked_scatter_(mask, a[mask]),
        "clone (for the two above)": lambda: b.clone(),
    }
    times = {k: _ms(f) for k, f in parts.items()}
    raw_new, raw_old = new.view(torch.uint8), old.view(torch.uint8)
    for enc in ("indices", "bitmap"):
        header, payload = encode(raw_new, raw_old, 2, (enc,))
        held = raw_old.clone()
        apply(held, header, payload)
        if not torch.equal(held, raw_new):
            raise SystemExit(f"{enc}: the payload applied differs from the new bytes")
        times[f"encode {enc}"] = _ms(lambda e=enc: encode(raw_new, raw_old, 2, (e,)))
        times[f"apply {enc} (with a clone)"] = _ms(lambda h=header, p=payload: apply(raw_old.clone(), h, p))
        # what a snapshot does per bucket: encode, and the held bytes become the new ones (fused on the GPU)
        held = raw_old.clone()
        times[f"encode_into {enc} (with a copy)"] = _ms(lambda e=enc, h=held: encode_into(raw_new, h.copy_(raw_old),
                                                                                          2, (e,)))
        with torch_path():
            times[f"encode_into {enc}, torch (with a copy)"] = _ms(
                lambda e=enc, h=held: encode_into(raw_new, h.copy_(raw_old), 2, (e,)))
            times[f"apply {enc}, torch (with a clone)"] = _ms(lambda h=header, p=payload: apply(raw_old.clone(), h, p))
    return times

if __name__ == "__main__":
    main()
