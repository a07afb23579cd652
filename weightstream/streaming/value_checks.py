"""The kernels that look at weights' bits for the values an engine checks an update for, on CUDA devices with Triton:
what the engine's one-launch check of a bucket launches (:mod:`~weightstream.receiver.value_kernel`), and what the
trainer's copies straight into an engine's weights run as they copy (:class:`~weightstream.streaming.copies.PieceCopy`
with a :class:`WordCheck`), so that the engine makes no pass of its own over what was written. They look for:

- a floating-point weight whose exponent bits are all ones (NaN or an infinity: the torch path's test);
- float8 e4m3 bytes 0x7f and 0xff (its only NaN; it has no infinity);
- a block-FP8 scale (float32) that is not in (0, 2**32] (the engine's ``MAX_FP8_SCALE``; negative, zero, NaN and
  infinite scales included), read as an integer: positive floats order as their bits do.

A kernel raises one flag (an int32 on the device, never lowered by it) where anything may be wrong; only then does
the torch path (:mod:`~weightstream.receiver.values`) look tensor by tensor, to name what is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from weightstream.common.triton_kernel import LazyKernel
from weightstream.wire.fp8 import SCALE_SUFFIX

__all__ = ["PIECE_BYTES", "KINDS", "DTYPES", "SCALE", "WIDTH", "MAX_SCALE_BITS", "EXPONENT_BITS", "kind_of",
           "available", "lanes_kernel", "Piece", "tensor_pieces", "piece_table", "PieceCheck",
           "warm"]

# Each program's share: a 512 MiB bucket is looked at by 4,096 programs, one layer's query, key and value weights of
# Qwen3-8B (48 MiB) by 384 (at 1 MiB a piece, 48 programs took 0.3 ms over them on an H200: too few to fill it).
PIECE_BYTES = 128 << 10
_BLOCK = 1024
# What a piece holds, as the kernel's branches name it: floats by the mask of their exponent bits.
KINDS: dict[torch.dtype, int] = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float8_e4m3fn: 3,
                                 torch.float8_e5m2: 5, torch.float64: 6}
DTYPES = {kind: dtype for dtype, kind in KINDS.items()}
SCALE = 4  # a block-FP8 scale (float32)
WIDTH = {0: 2, 1: 2, 2: 4, 3: 1, 4: 4, 5: 1, 6: 8}  # bytes of one element of each kind
MAX_SCALE_BITS = 0x4F800000  # 2**32 as float32 bits
# The bits a weight of each kind has all set where it is NaN or an infinity (e4m3: where it is NaN).
EXPONENT_BITS = {0: 0x7F80, 1: 0x7C00, 2: 0x7F800000, 3: 0x7F, 5: 0x7C, 6: 0x7FF0000000000000}


def kind_of(dtype: torch.dtype, name: str) -> int | None:
    """The kind of a tensor named ``name`` of ``dtype``: :data:`SCALE` for a block-FP8 scale, its :data:`KINDS` entry
    for a float, None for anything else (not a float, or a float no kind names)."""
    if dtype == torch.float32 and name.endswith(SCALE_SUFFIX):
        return SCALE
    return KINDS.get(dtype) if dtype.is_floating_point else None


@dataclass(frozen=True, slots=True)
class _Kernels:
    check_pieces: Any  # the launch over a table of pieces (address, elements, kind)
    lanes: Any  # the test of one word's lanes, for other kernels to call


def _build(triton: Any, tl: Any) -> _Kernels:
    @triton.jit
    def word_lanes_bad(v, BITS: tl.constexpr, LANE: tl.constexpr, WORD: tl.constexpr):
        """Per word of ``v`` (``WORD``-bit integers, each holding ``WORD // LANE`` elements of ``LANE`` bits): 1
        where an element has every bit of ``BITS`` set, as int32."""
        bad = (v & BITS) == BITS
        for i in tl.static_range(1, WORD // LANE):
            bad = bad | (((v >> (i * LANE)) & BITS) == BITS)
        return bad.to(tl.int32)

    @triton.jit
    def _bits(p, n, flag, dtype: tl.constexpr, BITS: tl.constexpr, WORD: tl.constexpr, BLOCK: tl.constexpr):
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        q = p.to(tl.pointer_type(dtype))
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            bad |= word_lanes_bad(tl.load(q + offs, mask=offs < n, other=0), BITS, WORD, WORD)
        tl.atomic_max(flag, tl.max(bad, axis=0))

    @triton.jit
    def _scales(p, n, flag, BLOCK: tl.constexpr):
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        q = p.to(tl.pointer_type(tl.int32))
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(q + offs, mask=offs < n, other=1)
            bad |= ((v <= 0) | (v > 0x4F800000)).to(tl.int32)  # MAX_SCALE_BITS
        tl.atomic_max(flag, tl.max(bad, axis=0))

    @triton.jit
    def check_pieces(addr_tab, len_tab, kind_tab, flag, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        p = tl.load(addr_tab + pid)
        n = tl.load(len_tab + pid)
        kind = tl.load(kind_tab + pid)
        if kind == 0:
            _bits(p, n, flag, tl.int16, 0x7F80, 16, BLOCK)
        elif kind == 1:
            _bits(p, n, flag, tl.int16, 0x7C00, 16, BLOCK)
        elif kind == 2:
            _bits(p, n, flag, tl.int32, 0x7F800000, 32, BLOCK)
        elif kind == 3:
            _bits(p, n, flag, tl.int8, 0x7F, 8, BLOCK)
        elif kind == 4:
            _scales(p, n, flag, BLOCK)
        elif kind == 5:
            _bits(p, n, flag, tl.int8, 0x7C, 8, BLOCK)
        else:
            _bits(p, n, flag, tl.int64, 0x7FF0000000000000, 64, BLOCK)

    return _Kernels(check_pieces, word_lanes_bad)


# The kernels, compiled on their first launch (None without Triton); WEIGHTSTREAM_CHECK_KERNEL=0 keeps the torch path.
_compile = LazyKernel(_build, "WEIGHTSTREAM_CHECK_KERNEL")


def available(device: torch.device) -> bool:
    """On ``device``, with Triton present, unless ``WEIGHTSTREAM_CHECK_KERNEL=0``."""
    return _compile.available(device)


def lanes_kernel() -> Any:
    """The Triton function that tests a word's lanes (``word_lanes_bad(v, BITS, LANE, WORD)``), for a kernel of
    another module to call: present wherever :func:`available` is. (A kernel resolves a name among its module's
    globals first: the name it is called by must be no global's there.)"""
    return _compile().lanes


Piece = tuple[int, int, int]  # (device address, elements, kind)


def tensor_pieces(named: Sequence[tuple[str, Tensor]]) -> list[Piece] | None:
    """The pieces the kernel looks at in ``named`` (contiguous tensors; each float tensor cut into pieces of at most
    :data:`PIECE_BYTES`, tensors of no float kind left out); None where one is a float of a dtype no kind names (the
    kernel cannot look at it)."""
    pieces: list[Piece] = []
    for name, t in named:
        kind = kind_of(t.dtype, name)
        if kind is None:
            if t.dtype.is_floating_point:
                return None
            continue
        if not t.is_contiguous():
            raise ValueError(f"{name}: the value check looks at contiguous tensors only")
        width, address, total = WIDTH[kind], t.data_ptr(), t.numel() * t.element_size()
        for at in range(0, total, PIECE_BYTES):
            pieces.append((address + at, (min(total, at + PIECE_BYTES) - at) // width, kind))
    return pieces


def piece_table(rows: Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """A kernel's table of pieces (one row per field, one column per piece) on ``device``, its columns made even (a
    piece of zeros past the last, which no program reads): Triton compiles a kernel apart for pointer arguments that
    are not 16-byte aligned, and the rows of a table with an odd count of 8-byte columns alternate, so a table of
    another parity than the one launched ahead of an update would compile in it (200 ms on an H200)."""
    width = len(rows[0]) + len(rows[0]) % 2
    return torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.int64).to(device)


class PieceCheck:
    """``pieces`` ready to launch: their table on ``flag``'s device, made once (whoever made the pieces holds the
    tensors they lie in, so that the addresses stay theirs). A launch raises ``flag`` where anything may be wrong and
    never lowers it: the caller zeroes it first."""

    def __init__(self, pieces: Sequence[Piece], flag: Tensor):
        self.flag = flag
        self.pieces = len(pieces)
        self.table = piece_table([[p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces]],
                                 flag.device)
        self.kernel = _compile().check_pieces if self.pieces else None

    def __call__(self) -> Tensor:
        """Launch on the current stream; ``flag``, on the device."""
        if self.kernel is not None:
            self.kernel[(self.pieces,)](self.table[0], self.table[1], self.table[2], self.flag, BLOCK=_BLOCK)
        return self.flag


def warm(device: torch.device) -> None:
    """Launch the check once on ``device`` where it runs, over a few zeros of each kind (its first launch compiles
    or loads it, tens of milliseconds): then before an update, not in it."""
    if not available(device):
        return
    scratch = torch.zeros(64, dtype=torch.uint8, device=device)
    PieceCheck([(scratch.data_ptr() + 8 * kind, 1, kind) for kind in WIDTH], torch.zeros(1, dtype=torch.int32,
                                                                                          device=device))()
