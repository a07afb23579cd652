"""Many contiguous device-to-device copies in one kernel launch.

``torch._foreach_copy_`` fills a bucket with a few fused launches, but its kernel takes at most 320 blocks of
64 Ki elements per launch, so thousands of mid-sized tensors (the experts of a MoE model) become hundreds of
small launches that leave the GPU part idle. :class:`PieceCopy` cuts every copy into pieces of at most
``PIECE_BYTES`` and copies all of them in one launch of a Triton kernel, one program per piece, reading the
addresses from a table made once. It is built for copies whose addresses do not change (a kept plan's views
of live parameters into a kept bucket buffer; the plan is re-made when a parameter moves) and is used only
on CUDA devices where Triton is present; everything else keeps ``_foreach_copy_``.

A :class:`PieceCopy` with a :class:`WordCheck` also looks at every word it copies for the values an engine checks an
update for (:mod:`~weightstream.streaming.value_checks`) and raises the check's flag where it finds one: copies
straight into an engine's weights are so checked as they are made, with no second pass over what they wrote.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from weightstream.common.triton_kernel import LazyKernel
from weightstream.streaming import value_checks
from weightstream.streaming.value_checks import EXPONENT_BITS, WIDTH, piece_table

__all__ = ["PIECE_BYTES", "available", "plan_pieces", "WordCheck", "PieceCopy", "batched_copy", "warm_variants",
           "warm_kernel"]


# An update launches one copy per bucket (~0.5 GB): at 512 KiB a piece, fewer programs than an H200 holds at once,
# 1.13x a device copy of the same bytes; at 128 KiB and 16 warps, 1.07x (tools/gpu_copy_sweep.py, docs/benchmarks.md).
PIECE_BYTES = 128 << 10
_BLOCK = 2048  # elements a program moves per step
_WARPS = 16  # per program


@dataclass(frozen=True, slots=True)
class _Kernels:
    copy: Any
    copy_check: Any | None  # None where the value checks' kernels are switched off


def _build(triton: Any, tl: Any) -> _Kernels:
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

    if not value_checks.available(torch.device("cuda")):
        return _Kernels(copy_pieces, None)
    word_lanes_bad = value_checks.lanes_kernel()

    @triton.jit
    def copy_check_pieces(src_tab, dst_tab, len_tab, flag, ELEM: tl.constexpr, BITS: tl.constexpr,
                          LANE: tl.constexpr, WORD: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        src = tl.load(src_tab + pid).to(tl.pointer_type(ELEM))
        dst = tl.load(dst_tab + pid).to(tl.pointer_type(ELEM))
        n = tl.load(len_tab + pid)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            v = tl.load(src + offs, mask=mask, other=0)
            tl.store(dst + offs, v, mask=mask)
            bad |= word_lanes_bad(v, BITS, LANE, WORD)
        tl.atomic_max(flag, tl.max(bad, axis=0))

    return _Kernels(copy_pieces, copy_check_pieces)


# The kernel, compiled on its first launch (None without Triton); WEIGHTSTREAM_PIECE_COPY=0 keeps _foreach_copy_.
_compile = LazyKernel(_build, "WEIGHTSTREAM_PIECE_COPY")


def available(device: torch.device, checked: bool = False) -> bool:
    """On ``device``, with Triton present, unless ``WEIGHTSTREAM_PIECE_COPY=0``; ``checked``: copies that check what
    they copy too (unless ``WEIGHTSTREAM_CHECK_KERNEL=0`` as well)."""
    return _compile.available(device) and (not checked or value_checks.available(device))


@dataclass(frozen=True, slots=True)
class WordCheck:
    """What a :class:`PieceCopy` looks for in the words it copies: weights of value kind ``kind``
    (:data:`~weightstream.streaming.value_checks.KINDS`) holding NaN or an infinity; ``flag`` (an int32 on the
    copy's device) is raised where one is found, and never lowered."""

    kind: int
    flag: Tensor


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
    the addresses in the table stay theirs. ``check``: every word copied is looked at too (:class:`WordCheck`; the
    tensors are all of its kind's dtype)."""

    def __init__(self, dst: Sequence[Tensor], src: Sequence[Tensor], check: WordCheck | None = None):
        import triton.language as tl

        self.held = (list(dst), list(src))
        unit, srcs, dsts, lens = plan_pieces(dst, src, PIECE_BYTES)
        self.elem = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}[unit]
        self.table = piece_table([srcs, dsts, lens], dst[0].device)
        self.pieces = len(lens)
        self.check = check
        if check is not None and (check.kind not in EXPONENT_BITS or unit % WIDTH[check.kind]):
            raise ValueError(f"a checked piece copy of kind {check.kind} over words of {unit} bytes")
        kernels = _compile()
        self.kernel = kernels.copy if check is None else kernels.copy_check
        if self.kernel is None:
            raise RuntimeError("a checked piece copy, but the value checks' kernels are switched off")
        self.unit = unit

    def __call__(self) -> None:
        if self.pieces:
            self._launch(self.pieces, self.table, None if self.check is None else self.check.flag)

    def _launch(self, pieces: int, table: Tensor, flag: Tensor | None) -> None:
        if self.check is None:
            self.kernel[(pieces,)](table[0], table[1], table[2], ELEM=self.elem, BLOCK=_BLOCK, num_warps=_WARPS)
            return
        kind = self.check.kind
        self.kernel[(pieces,)](table[0], table[1], table[2], flag, ELEM=self.elem, BITS=EXPONENT_BITS[kind],
                               LANE=8 * WIDTH[kind], WORD=8 * self.unit, BLOCK=_BLOCK, num_warps=_WARPS)

    @property
    def variant(self) -> tuple[int, int | None]:
        """What the kernel is compiled for: the word's bytes, and the kind checked (None: a plain copy)."""
        return self.unit, None if self.check is None else self.check.kind

    def warm(self) -> None:
        """Launch this copy's kernel variant once, on a word of scratch memory (its first launch compiles it)."""
        device = self.table.device
        scratch = torch.zeros(2 * self.unit, dtype=torch.uint8, device=device)
        table = piece_table([[scratch.data_ptr()], [scratch.data_ptr() + self.unit], [1]], device)
        self._launch(1, table, torch.zeros(1, dtype=torch.int32, device=device))


def warm_variants(calls: Iterable[Callable[[], Any]]) -> None:
    """Each kernel variant among the :class:`PieceCopy` of ``calls`` launched once (:meth:`PieceCopy.warm`)."""
    seen: set[tuple[int, int | None]] = set()
    for call in calls:
        if isinstance(call, PieceCopy) and call.variant not in seen:
            seen.add(call.variant)
            call.warm()


def batched_copy(dst: list[Tensor], src: list[Tensor], *, stable: bool,
                 check: WordCheck | None = None) -> Callable[[], Any]:
    """``dst[i].copy_(src[i])`` for every i, as one call: a :class:`PieceCopy` where the addresses stay
    (``stable``: the caller keeps this for tensors that are not moved) and every pair is contiguous, of one
    dtype, on a CUDA device with Triton; else ``torch._foreach_copy_``. ``check``: the copy looks at what it copies
    too (a :class:`PieceCopy` is then required: the caller checked :func:`available` with ``checked``)."""
    if check is not None:
        return PieceCopy(dst, src, check)
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
