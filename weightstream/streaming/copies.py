"""Many contiguous device-to-device copies in one kernel launch.

``torch._foreach_copy_`` fills a bucket with a few fused launches, but its kernel takes at most 320 blocks of
64 Ki elements per launch, so thousands of mid-sized tensors (the experts of a MoE model) become hundreds of
small launches that leave the GPU part idle. :class:`PieceCopy` cuts every copy into pieces of at most
``PIECE_BYTES`` and copies all of them in one launch of a Triton kernel, one program per piece, reading the
addresses from a table made once. It is built for copies whose addresses do not change (a kept plan's views
of live parameters into a kept bucket buffer; the plan is re-made when a parameter moves) and is used only
on CUDA devices where Triton is present; everything else keeps ``_foreach_copy_``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from weightstream.common.triton_kernel import LazyKernel

__all__ = ["PIECE_BYTES", "available", "plan_pieces", "PieceCopy", "batched_copy", "warm_kernel"]


PIECE_BYTES = 512 << 10
_BLOCK = 2048  # elements a program moves per step


def _build(triton: Any, tl: Any) -> Any:
    @triton.jit
    def copy_pieces(src_tab, dst_tab, len_tab, ELEM: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        src = tl.load(src_tab + pid).to(tl.pointer_type(ELEM))
        dst = tl.load(dst_tab + pid).to(tl.pointer_type(ELEM))
        n = tl.load(len_tab + pid)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return copy_pieces


# The kernel, compiled on its first launch (None without Triton); WEIGHTSTREAM_PIECE_COPY=0 keeps _foreach_copy_.
_compile = LazyKernel(_build, "WEIGHTSTREAM_PIECE_COPY")


def available(device: torch.device) -> bool:
    """On ``device``, with Triton present, unless ``WEIGHTSTREAM_PIECE_COPY=0``."""
    return _compile.available(device)


def plan_pieces(dst: Sequence[Tensor], src: Sequence[Tensor], piece_bytes: int = PIECE_BYTES
                ) -> tuple[int, list[int], list[int], list[int]]:
    """The element size the copies share (the largest of 8, 4, 2, 1 dividing every address and length) and
    the pieces: source addresses, destination addresses and lengths in elements, each piece at most
    ``piece_bytes``. Every pair must be contiguous and of equal byte size."""
    unit = 8
    spans = []
    for d, s in zip(dst, src, strict=True):
        n = d.numel() * d.element_size()
        if not (d.is_contiguous() and s.is_contiguous()) or n != s.numel() * s.element_size():
            raise ValueError("piece copies need contiguous pairs of equal byte size")
        if n == 0:
            continue
        spans.append((s.data_ptr(), d.data_ptr(), n))
        unit = math.gcd(unit, s.data_ptr(), d.data_ptr(), n)
    step = max(unit, piece_bytes - piece_bytes % unit)
    srcs, dsts, lens = [], [], []
    for s_addr, d_addr, n in spans:
        for at in range(0, n, step):
            srcs.append(s_addr + at)
            dsts.append(d_addr + at)
            lens.append(min(step, n - at) // unit)
    return unit, srcs, dsts, lens


class PieceCopy:
    """``dst[i].copy_(src[i])`` for every i, in one launch on the current stream. The tensors are held, so
    the addresses in the table stay theirs."""

    def __init__(self, dst: Sequence[Tensor], src: Sequence[Tensor]):
        import triton.language as tl

        self.held = (list(dst), list(src))
        unit, srcs, dsts, lens = plan_pieces(dst, src)
        self.elem = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}[unit]
        self.table = torch.tensor([srcs, dsts, lens], dtype=torch.int64).to(dst[0].device)
        self.pieces = len(lens)
        self.kernel = _compile()

    def __call__(self) -> None:
        if self.pieces:
            self.kernel[(self.pieces,)](self.table[0], self.table[1], self.table[2], ELEM=self.elem, BLOCK=_BLOCK)


def batched_copy(dst: list[Tensor], src: list[Tensor], *, stable: bool) -> Callable[[], Any]:
    """``dst[i].copy_(src[i])`` for every i, as one call: a :class:`PieceCopy` where the addresses stay
    (``stable``: the caller keeps this for tensors that are not moved) and every pair is contiguous, of one
    dtype, on a CUDA device with Triton; else ``torch._foreach_copy_``."""
    if (stable and dst and available(dst[0].device)
            and all(d.dtype == s.dtype and d.shape == s.shape and d.is_contiguous() and s.is_contiguous()
                    and d.device == s.device for d, s in zip(dst, src, strict=True))):
        return PieceCopy(dst, src)
    return partial(torch._foreach_copy_, dst, src)


def warm_kernel(device: torch.device) -> None:
    """Compile the kernel (a first launch takes a second or two) before it is needed, where it is used."""
    if available(device):
        one = torch.zeros(8, dtype=torch.int64, device=device)
        PieceCopy([one[:4]], [one[4:]])()
