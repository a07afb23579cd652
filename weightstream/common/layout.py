"""Byte layout: tensors back to back in one flat buffer, each start aligned."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ALIGN", "round_up", "layout"]


ALIGN = 256


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def layout(items: Sequence[Sequence[int]], align: int = ALIGN, start: int = 0) -> tuple[list[tuple[int, ...]], int]:
    """Offsets of the tensors of ``items`` laid out one after another from ``start``; and the end."""
    offsets, end = [], start
    for sizes in items:
        item_offsets = []
        for size in sizes:
            off = round_up(end, align)
            item_offsets.append(off)
            end = off + size
        offsets.append(tuple(item_offsets))
    return offsets, end
