"""A bucket's value checks (:mod:`~weightstream.receiver.values`) in one kernel launch, on CUDA devices with Triton.

The torch path looks at a bucket with a few reductions per dtype, each over views cut out of the buffer per update;
a block-FP8 bucket of a Qwen3-30B-A3B holds 635 tensors whose values alternate with their scales, and cutting,
joining and reducing them costs milliseconds of host time per bucket, more than the wire takes to bring the next.
Here every tensor (or stretch of tensors of one dtype back to back) is cut into pieces once per bucket layout and
buffer (:func:`plan_checks`), and one launch of :mod:`~weightstream.streaming.value_checks`'s kernel looks at every
piece's bits (NaN and infinities; block-FP8 scales out of range).

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

from weightstream.streaming import value_checks
from weightstream.streaming.value_checks import DTYPES, KINDS, PIECE_BYTES, SCALE, WIDTH, available, kind_of

__all__ = ["PIECE_BYTES", "KINDS", "DTYPES", "SCALE", "CheckPlan", "stretches", "plan_checks", "PieceCheck",
           "available", "bucket_flag"]

Run = tuple[torch.dtype, list[int], list[tuple[str, Any]]]


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
                spans.append((start, start + numel * dtype.itemsize, kind_of(dtype, name)))
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




def plan_checks(runs: Sequence[Run]) -> CheckPlan | None:
    """The pieces of a bucket cut by ``runs``: each of its :func:`stretches` cut into pieces of at most
    :data:`PIECE_BYTES`; None where a run is of a floating-point dtype no kind names."""
    if any(dtype.is_floating_point and dtype not in KINDS for dtype, _, _ in runs):
        return None
    offsets, lengths, kinds = [], [], []
    for kind, start, end in stretches(runs):
        width = WIDTH[kind]
        for at in range(start, end, PIECE_BYTES):
            offsets.append(at)
            lengths.append((min(end, at + PIECE_BYTES) - at) // width)
            kinds.append(kind)
    return CheckPlan(tuple(offsets), tuple(lengths), tuple(kinds))


class PieceCheck:
    """A :class:`CheckPlan` on one buffer, ready to launch (:class:`~weightstream.streaming.value_checks.PieceCheck`
    at the buffer's addresses), and the flag the kernel raises. ``raw`` is held, so the addresses stay its."""

    def __init__(self, raw: Tensor, plan: CheckPlan):
        self.raw = raw
        base = raw.data_ptr()
        self.check = value_checks.PieceCheck(
            [(base + o, n, kind) for o, n, kind in zip(plan.offsets, plan.lengths, plan.kinds, strict=True)],
            torch.zeros(1, dtype=torch.int32, device=raw.device))

    def __call__(self) -> Tensor:
        """Launch the check on the current stream; the flag (nonzero: something may be wrong), on the device."""
        self.check.flag.zero_()
        return self.check()


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
