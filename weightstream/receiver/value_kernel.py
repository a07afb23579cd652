"""A bucket's value checks (:mod:`~weightstream.receiver.values`) in one kernel launch, on CUDA devices with Triton.

The torch path looks at a bucket with a few reductions per dtype, each over views cut out of the buffer per update;
a block-FP8 bucket of a Qwen3-30B-A3B holds 635 tensors whose values alternate with their scales, and cutting,
joining and reducing them costs milliseconds of host time per bucket, more than the wire takes to bring the next.
Here every tensor (or stretch of tensors of one dtype back to back) is cut into pieces once per bucket layout and
buffer (:func:`plan_checks`), and one launch looks at every piece's bits:

- a floating-point weight whose exponent bits are all ones (NaN or an infinity: the same test as the torch path's);
- float8 e4m3 bytes 0x7f and 0xff (its only NaN; it has no infinity);
- a block-FP8 scale (float32) that is not in (0, :data:`~weightstream.receiver.values.MAX_FP8_SCALE`] (negative,
  zero, NaN and infinite scales included), read as an integer: positive floats order as their bits do.

It answers one flag: whether anything may be wrong. Only then does the caller look tensor by tensor, on the torch
path, to name what is wrong (a stretch's padding between two tensors may flag a bucket whose tensors are all fine;
the torch path then names none)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from weightstream.common.triton_kernel import LazyKernel
from weightstream.wire.fp8 import SCALE_SUFFIX

__all__ = ["PIECE_BYTES", "KINDS", "DTYPES", "SCALE", "CheckPlan", "stretches", "plan_checks", "PieceCheck",
           "available", "bucket_flag"]

PIECE_BYTES = 1 << 20  # each program's share of a stretch: a 512 MiB bucket is looked at by 512 programs
_BLOCK = 1024
# What a piece holds, as the kernel's branches name it: floats by the mask of their exponent bits.
KINDS: dict[torch.dtype, int] = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float8_e4m3fn: 3,
                                 torch.float8_e5m2: 5, torch.float64: 6}
DTYPES = {kind: dtype for dtype, kind in KINDS.items()}
SCALE = 4  # a block-FP8 scale (float32)
_WIDTH = {0: 2, 1: 2, 2: 4, 3: 1, 4: 4, 5: 1, 6: 8}
_MAX_SCALE_BITS = 0x4F800000  # MAX_FP8_SCALE (2**32) as float32 bits


def _build(triton: Any, tl: Any) -> Any:
    @triton.jit
    def _bits(p, n, flag, dtype: tl.constexpr, bits: tl.constexpr, BLOCK: tl.constexpr):
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        q = p.to(tl.pointer_type(dtype))
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(q + offs, mask=offs < n, other=0)
            bad |= ((v & bits) == bits).to(tl.int32)
        tl.atomic_max(flag, tl.max(bad, axis=0))

    @triton.jit
    def _scales(p, n, flag, BLOCK: tl.constexpr):
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        q = p.to(tl.pointer_type(tl.int32))
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(q + offs, mask=offs < n, other=1)
            bad |= ((v <= 0) | (v > 0x4F800000)).to(tl.int32)
        tl.atomic_max(flag, tl.max(bad, axis=0))

    @triton.jit
    def check_pieces(addr_tab, len_tab, kind_tab, flag, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        p = tl.load(addr_tab + pid)
        n = tl.load(len_tab + pid)
        kind = tl.load(kind_tab + pid)
        if kind == 0:
            _bits(p, n, flag, tl.int16, 0x7F80, BLOCK)
        elif kind == 1:
            _bits(p, n, flag, tl.int16, 0x7C00, BLOCK)
        elif kind == 2:
            _bits(p, n, flag, tl.int32, 0x7F800000, BLOCK)
        elif kind == 3:
            _bits(p, n, flag, tl.int8, 0x7F, BLOCK)
        elif kind == 4:
            _scales(p, n, flag, BLOCK)
        elif kind == 5:
            _bits(p, n, flag, tl.int8, 0x7C, BLOCK)
        else:
            _bits(p, n, flag, tl.int64, 0x7FF0000000000000, BLOCK)

    return check_pieces


# The kernel, compiled on its first launch (None without Triton); WEIGHTSTREAM_CHECK_KERNEL=0 keeps the torch path.
_compile = LazyKernel(_build, "WEIGHTSTREAM_CHECK_KERNEL")

Run = tuple[torch.dtype, list[int], list[tuple[str, Any]]]


def available(device: torch.device) -> bool:
    """On ``device``, with Triton present, unless ``WEIGHTSTREAM_CHECK_KERNEL=0``."""
    return _compile.available(device)


@dataclass(frozen=True, slots=True)
class CheckPlan:
    """The pieces of a bucket to look at: byte offsets in the buffer, lengths in elements, and kinds (:data:`KINDS`,
    :data:`SCALE`); None where a run has a dtype the kernel does not know (the torch path then checks the bucket)."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    kinds: tuple[int, ...]


def stretches(runs: Sequence[Run]) -> list[tuple[int, int, int]]:
    """``(kind, first byte, end byte)`` of each stretch of consecutive floating-point tensors of one kind
    (:data:`KINDS`, :data:`SCALE`), in the buffer's order: a tensor of another kind (or of none: not a float, or a
    float no kind names) between two ends a stretch, and each block-FP8 scale is a stretch of its own."""
    spans: list[tuple[int, int, int | None]] = []  # (first byte, end byte, kind) of each tensor
    for dtype, sizes, payload in runs:
        pos = 0
        for (gap, numel), (name, _) in zip(zip(sizes[::2], sizes[1::2], strict=True), payload, strict=True):
            start = (pos + gap) * dtype.itemsize
            pos += gap + numel
            if numel:
                spans.append((start, start + numel * dtype.itemsize, _kind(dtype, name)))
    spans.sort(key=lambda span: span[0])
    out: list[list[int]] = []
    last: int | None = None  # the kind of the tensor before
    for start, end, kind in spans:
        if kind is not None and kind == last and kind != SCALE:
            out[-1][2] = end
        elif kind is not None:
            out.append([kind, start, end])
        last = kind
    return [(kind, start, end) for kind, start, end in out]


def _kind(dtype: torch.dtype, name: str) -> int | None:
    if dtype == torch.float32 and name.endswith(SCALE_SUFFIX):
        return SCALE
    return KINDS.get(dtype) if dtype.is_floating_point else None


def plan_checks(runs: Sequence[Run]) -> CheckPlan | None:
    """The pieces of a bucket cut by ``runs``: each of its :func:`stretches` cut into pieces of at most
    :data:`PIECE_BYTES`; None where a run is of a floating-point dtype no kind names."""
    if any(dtype.is_floating_point and dtype not in KINDS for dtype, _, _ in runs):
        return None
    offsets, lengths, kinds = [], [], []
    for kind, start, end in stretches(runs):
        width = _WIDTH[kind]
        for at in range(start, end, PIECE_BYTES):
            offsets.append(at)
            lengths.append((min(end, at + PIECE_BYTES) - at) // width)
            kinds.append(kind)
    return CheckPlan(tuple(offsets), tuple(lengths), tuple(kinds))


class PieceCheck:
    """A :class:`CheckPlan` on one buffer, ready to launch: its table of absolute addresses on the device, and the
    flag the kernel raises. ``raw`` is held, so the addresses in the table stay its."""

    def __init__(self, raw: Tensor, plan: CheckPlan):
        self.raw = raw
        base = raw.data_ptr()
        self.table = torch.tensor([[base + o for o in plan.offsets], list(plan.lengths), list(plan.kinds)],
                                  dtype=torch.int64).to(raw.device)
        self.flag = torch.zeros(1, dtype=torch.int32, device=raw.device)
        self.pieces = len(plan.kinds)
        self.kernel = _compile()

    def __call__(self) -> Tensor:
        """Launch the check on the current stream; the flag (nonzero: something may be wrong), on the device."""
        self.flag.zero_()
        if self.pieces:
            self.kernel[(self.pieces,)](self.table[0], self.table[1], self.table[2], self.flag, BLOCK=_BLOCK)
        return self.flag


_CHECKS: OrderedDict[tuple[int, int, int], tuple[Sequence[Run], PieceCheck | None]] = OrderedDict()
KEPT_CHECKS = 512  # bucket layouts x buffers: a Qwen3-30B-A3B's 115 buckets through two kept buffers, twice over


def bucket_flag(raw: Tensor, runs: Sequence[Run]) -> Tensor | None:
    """The flag of :class:`PieceCheck` for ``raw`` cut by ``runs`` (made once per layout and buffer, and kept: the
    entry holds ``runs``, so no other layout can come by the same key), launched; None where the kernel cannot look
    at this bucket (:func:`plan_checks`)."""
    key = (id(runs), raw.data_ptr(), raw.numel())
    entry = _CHECKS.get(key)
    if entry is None or entry[0] is not runs:
        plan = plan_checks(runs)
        entry = (runs, None if plan is None else PieceCheck(raw, plan))
        _CHECKS[key] = entry
        while len(_CHECKS) > KEPT_CHECKS:
            _CHECKS.popitem(last=False)
    else:
        _CHECKS.move_to_end(key)
    check = entry[1]
    return None if check is None else check()
