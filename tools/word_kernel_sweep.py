"""The word kernels' launch shapes swept on one 512 MiB bucket of bf16 words: words per program (``BLOCK``) and
warps per program, for the checksum's sums, the comparison (``compare_pack``) and the packing and the expansion
of changed words (``move``), against a device copy of the same bytes. Every shape's results are checked
against the shipped shape's, bit for bit.

``python3 tools/word_kernel_sweep.py [--mib 512] [--changed 0.05]`` (best of 5 runs each)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from gpu_delta_ops import _ms

from weightstream.common import word_kernels as wk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--changed", type=float, default=0.05)
    args = ap.parse_args()
    n = (args.mib << 20) // 2
    dev = torch.device("cuda")
    old = torch.randn(n, device=dev).to(torch.bfloat16).view(torch.int16)
    new = old.clone()
    where = torch.rand(n, device=dev) < args.changed
    new[where] += 1
    held = old.clone()
    copy = _ms(lambda: held.copy_(old))
    print(f"{args.mib} MiB, {args.changed:.0%} changed: device copy {copy:.3f} ms "
          f"({2 * n * 2 / copy / 1e6:.0f} GB/s read + written)")
    kernels = {"sums": wk._sums(triton, tl), "compare_pack": wk._compare_pack(triton, tl), "move": wk._move(triton, tl)}
    ref_count, ref_bitmap, ref_counts = wk.compare_pack(new, held.copy_(old))
    ref_sums = wk.checksum_sums(old.view(torch.int32))
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            t = _shape(kernels, block, warps, old, new, held, where, copy, (ref_count, ref_bitmap, ref_sums))
            print(f"BLOCK {block:5d} warps {warps:2d}: " + "  ".join(f"{k} {v:.3f}" for k, v in t.items()) + " ms",
                  flush=True)


def _shape(kernels: dict, block: int, warps: int, old: torch.Tensor, new: torch.Tensor, held: torch.Tensor,
           where: torch.Tensor, copy: float, ref: tuple) -> dict[str, float]:
    """One launch shape: each kernel timed, its results checked against the shipped shape's."""
    ref_count, ref_bitmap, ref_sums = ref
    dev, n = old.device, old.numel()
    grid = (n + block - 1) // block
    words32 = old.view(torch.int32)
    g32 = (words32.numel() + block - 1) // block
    s1 = torch.empty(g32, dtype=torch.int64, device=dev)
    s2 = torch.empty_like(s1)
    out = {"sums": _ms(lambda: kernels["sums"][(g32,)](words32, words32.numel(), s1, s2, B=block, M=wk.MOD,
                                                       num_warps=warps))}
    assert (int(s1.sum()), int(s2.sum())) == ref_sums
    bitmap = torch.empty((n + 7) // 8, dtype=torch.uint8, device=dev)
    counts = torch.empty(grid, dtype=torch.int32, device=dev)

    def compare() -> None:
        held.copy_(old)
        kernels["compare_pack"][(grid,)](new, held, bitmap, counts, n, B=block, num_warps=warps)

    out["compare_pack"] = _ms(compare) - copy
    assert torch.equal(bitmap, ref_bitmap) and int(counts.sum()) == ref_count and torch.equal(held, new)
    starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    values = torch.empty(ref_count, dtype=torch.int16, device=dev)
    out["pack"] = _ms(lambda: kernels["move"][(grid,)](new, bitmap, starts, values, bitmap, n, B=block, PACK=True,
                                                       POSITIONS=False, num_warps=warps))
    assert torch.equal(values, new[where])

    def expand() -> None:
        held.copy_(old)
        kernels["move"][(grid,)](held, bitmap, starts, values, bitmap, n, B=block, PACK=False, POSITIONS=False,
                                 num_warps=warps)

    out["expand"] = _ms(expand) - copy
    assert torch.equal(held, new)
    return out

if __name__ == "__main__":
    main()
