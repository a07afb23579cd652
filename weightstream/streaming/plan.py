"""Bucket planning: a pure function of byte sizes, the same on every rank.

Items are the units that move together (one Megatron tensor and the HF tensors it becomes);
each item is a list of tensor sizes in bytes. Items are packed in order, greedily, into buckets
whose flat buffer (each tensor's start aligned to ``align`` bytes) stays within ``limit`` bytes;
an item that alone exceeds the limit gets a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightstream.common.layout import ALIGN, layout

__all__ = ["BucketPlan", "plan_buckets"]


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """One bucket: which items it holds and where each of their tensors starts in the buffer."""

    index: int
    items: range
    offsets: tuple[tuple[int, ...], ...]  # per item, per tensor
    nbytes: int


def plan_buckets(items: Sequence[Sequence[int]], limit: int, align: int = ALIGN,
                 keys: Sequence[object] | None = None) -> list[BucketPlan]:
    """Cut ``items`` into buckets of at most ``limit`` bytes, keeping their order; with ``keys`` (one per
    item), also wherever the key changes (a bucket holds items of one key)."""
    if limit <= 0:
        raise ValueError(f"bucket limit must be positive, got {limit}")
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment must be a power of two, got {align}")
    if keys is not None and len(keys) != len(items):
        raise ValueError(f"{len(keys)} keys for {len(items)} items")
    buckets: list[BucketPlan] = []
    first, end = 0, 0
    offsets: list[tuple[int, ...]] = []
    for i, sizes in enumerate(items):
        item_offsets, new_end = layout([sizes], align, end)
        if i > first and (new_end > limit or (keys is not None and keys[i] != keys[i - 1])):
            buckets.append(BucketPlan(len(buckets), range(first, i), tuple(offsets), end))
            first, offsets = i, []
            item_offsets, new_end = layout([sizes], align, 0)
        offsets.append(item_offsets[0])
        end = new_end
    if len(items) > first:
        buckets.append(BucketPlan(len(buckets), range(first, len(items)), tuple(offsets), end))
    return buckets
