"""Triton kernels over a buffer's words, for delta updates and their checks on the GPU: each does in one pass what
the torch operations in ``streaming.delta`` and ``wire.handles.checksum`` do in several, with the same results
bit for bit (the wire format and the checksum do not depend on which side ran which).

- :func:`checksum_sums`: the two sums of ``checksum`` (integer sums, exact modulo 2**64 in any order);
- :func:`compare_pack`: new words against held ones: the changed words written into the held ones (which then
  equal the new), one bit per word (the ``bitmap`` encoding's), and the count of changed words per block;
- :func:`compact`: the changed words' values (and positions) packed back to back, from that bitmap;
- :func:`expand_into`: a ``bitmap`` payload applied: each changed word's value written at its place.

Blocks of :data:`BLOCK` words, one program each; a block's changed words land at the block's offset (the
exclusive prefix sum of the counts before it) in their order within the block, as ``a[mask]`` orders them.
On CUDA devices with Triton, unless ``WEIGHTSTREAM_DELTA_KERNEL=0``; callers keep their torch path otherwise."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from weightstream.common.triton_kernel import LazyKernel

__all__ = ["MOD", "available", "checksum_sums", "compare_pack", "compact", "expand_into", "flagged"]


# Words per program and warps per program of the comparison and the moves (BLOCK a multiple of 8: a block's
# bitmap is whole bytes), and of the checksum's sums: the fastest shapes of ``tools/word_kernel_sweep.py`` on an
# H100 (per 512 MiB of bf16 words, 5% changed: comparison 0.47 ms, packing 0.66 ms against 0.81 ms at 4096
# words and 8 warps, expansion 0.37 ms; a device copy of the bucket 0.39 ms).
BLOCK, WARPS = 2048, 4
SUM_BLOCK, SUM_WARPS = 4096, 8
MOD = 65521  # the checksum's position weights: i % MOD + 1


def _sums(triton: Any, tl: Any) -> Any:
    @triton.jit
    def sums(words, n, s1, s2, B: tl.constexpr, M: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * B + tl.arange(0, B)
        inside = offs < n
        w = tl.load(words + offs, mask=inside, other=0).to(tl.int64)
        tl.store(s1 + pid, tl.sum(w, axis=0))
        tl.store(s2 + pid, tl.sum(w * (offs % M + 1), axis=0))

    return sums


def _compare_pack(triton: Any, tl: Any) -> Any:
    @triton.jit
    def compare_pack(new, held, bitmap, counts, n, B: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * B + tl.arange(0, B)
        inside = offs < n
        a = tl.load(new + offs, mask=inside, other=0)
        b = tl.load(held + offs, mask=inside, other=0)
        changed = (a != b) & inside
        tl.store(held + offs, a, mask=changed)
        flags = changed.to(tl.int32)
        tl.store(counts + pid, tl.sum(flags, axis=0))
        bits = tl.reshape(flags, (B // 8, 8)) << tl.arange(0, 8)[None, :]
        byte = pid.to(tl.int64) * (B // 8) + tl.arange(0, B // 8)
        tl.store(bitmap + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte < (n + 7) // 8)

    return compare_pack


def _move(triton: Any, tl: Any) -> Any:
    @triton.jit
    def move(dense, bitmap, starts, packed, positions, n, B: tl.constexpr, PACK: tl.constexpr,
             POSITIONS: tl.constexpr):
        """PACK: the flagged words of ``dense`` into ``packed`` back to back (and their positions, with POSITIONS);
        else each word of ``packed`` into its flagged place in ``dense``."""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * B + tl.arange(0, B)
        byte = pid.to(tl.int64) * (B // 8) + tl.arange(0, B // 8)
        bits = tl.load(bitmap + byte, mask=byte < (n + 7) // 8, other=0).to(tl.int32)
        flags = tl.reshape((bits[:, None] >> tl.arange(0, 8)[None, :]) & 1, (B,))
        changed = (flags != 0) & (offs < n)
        at = tl.load(starts + pid) + tl.cumsum(flags, axis=0) - 1
        if PACK:
            tl.store(packed + at, tl.load(dense + offs, mask=changed, other=0), mask=changed)
            if POSITIONS:
                tl.store(positions + at, offs.to(tl.int32), mask=changed)
        else:
            tl.store(dense + offs, tl.load(packed + at, mask=changed, other=0), mask=changed)

    return move


def _popcounts(triton: Any, tl: Any) -> Any:
    @triton.jit
    def popcounts(bitmap, counts, n, B: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * B + tl.arange(0, B)
        byte = pid.to(tl.int64) * (B // 8) + tl.arange(0, B // 8)
        packed = tl.load(bitmap + byte, mask=byte < (n + 7) // 8, other=0).to(tl.int32)
        flags = tl.reshape((packed[:, None] >> tl.arange(0, 8)[None, :]) & 1, (B,))
        tl.store(counts + pid, tl.sum(tl.where(offs < n, flags, 0), axis=0))

    return popcounts


def _build(triton: Any, tl: Any) -> dict[str, Any]:
    """Every kernel, each made by its own builder."""
    return {"sums": _sums(triton, tl), "compare_pack": _compare_pack(triton, tl), "move": _move(triton, tl),
            "popcounts": _popcounts(triton, tl)}


# Compiled on first launch (None without Triton); WEIGHTSTREAM_DELTA_KERNEL=0 keeps the torch operations.
_compile = LazyKernel(_build, "WEIGHTSTREAM_DELTA_KERNEL")


def available(device: torch.device) -> bool:
    """On ``device``: a CUDA device, Triton present, and ``WEIGHTSTREAM_DELTA_KERNEL`` not ``0``."""
    return _compile.available(device)


def _kernels() -> dict[str, Any]:
    made = _compile()
    if made is None:
        raise RuntimeError("the word kernels need Triton")
    return made


def _blocks(n: int, block: int = BLOCK) -> int:
    return max(1, (n + block - 1) // block)


def _starts(counts: Tensor) -> Tensor:
    """Each block's first slot: the exclusive prefix sum of ``counts`` (int64)."""
    return torch.cumsum(counts, 0, dtype=torch.int64) - counts


def checksum_sums(words: Tensor) -> tuple[int, int]:
    """Over int32 ``words``: the sum of the words and the sum of ``w_i * (i % 65521 + 1)``, each modulo 2**64."""
    n = words.numel()
    grid = _blocks(n, SUM_BLOCK)
    s1 = torch.empty(grid, dtype=torch.int64, device=words.device)
    s2 = torch.empty_like(s1)
    _kernels()["sums"][(grid,)](words, n, s1, s2, B=SUM_BLOCK, M=MOD, num_warps=SUM_WARPS)
    both = torch.stack([s1.sum(), s2.sum()]).tolist()
    return int(both[0]), int(both[1])


def compare_pack(new: Tensor, held: Tensor) -> tuple[int, Tensor, Tensor]:
    """``new`` against ``held`` (words of one dtype, same size; ``held`` then equals ``new``): how many changed,
    the bitmap of the changed ones (``ceil(n / 8)`` bytes) and the count per block."""
    n = new.numel()
    grid = _blocks(n)
    bitmap = torch.empty((n + 7) // 8, dtype=torch.uint8, device=new.device)
    counts = torch.empty(grid, dtype=torch.int32, device=new.device)
    _kernels()["compare_pack"][(grid,)](new, held, bitmap, counts, n, B=BLOCK, num_warps=WARPS)
    return int(counts.sum().item()), bitmap, counts


def compact(new: Tensor, bitmap: Tensor, counts: Tensor, values: Tensor, positions: Tensor | None) -> None:
    """The words of ``new`` that ``bitmap`` flags into ``values`` (same dtype) and, unless None, their positions
    into ``positions`` (int32), back to back in word order."""
    n = new.numel()
    _kernels()["move"][(_blocks(n),)](new, bitmap, _starts(counts), values, bitmap if positions is None else positions,
                                      n, B=BLOCK, PACK=True, POSITIONS=positions is not None, num_warps=WARPS)


def expand_into(held: Tensor, bitmap: Tensor, values: Tensor, counts: Tensor) -> None:
    """Each value of ``values`` written at the next word of ``held`` that ``bitmap`` flags; ``counts``: the
    bitmap's :func:`flagged` counts, whose sum the caller checked to be ``values``' size."""
    n = held.numel()
    _kernels()["move"][(_blocks(n),)](held, bitmap, _starts(counts), values, bitmap, n, B=BLOCK, PACK=False,
                                      POSITIONS=False, num_warps=WARPS)


def flagged(bitmap: Tensor, n: int) -> Tensor:
    """How many of the first ``n`` words ``bitmap`` flags, per block (int32; bits past word ``n`` not counted)."""
    grid = _blocks(n)
    counts = torch.empty(grid, dtype=torch.int32, device=bitmap.device)
    _kernels()["popcounts"][(grid,)](bitmap, counts, n, B=BLOCK, num_warps=WARPS)
    return counts
