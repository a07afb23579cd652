"""A bucket: one flat, aligned byte buffer and the metadata of the HF tensors inside it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from weightstream.common.layout import ALIGN, layout, round_up
from weightstream.models.spec import dtype_name
from weightstream.streaming.delta import DeltaHeader, word_size

__all__ = ["Shard", "TensorMeta", "extent", "gap_ranges", "view_tensor", "typed_buffer", "typed_runs", "typed_views",
           "Bucket"]


@dataclass(frozen=True, slots=True)
class Shard:
    """Where a per-rank tensor sits in the whole HF tensor: rows (or columns) ``[start, start+length)``
    of ``full`` along ``dim``."""

    dim: int
    start: int
    length: int
    full: int


@dataclass(frozen=True, slots=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket buffer
    shard: Shard | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def extent(metas: Iterable[TensorMeta]) -> int:
    """The bytes of a bucket laid out as ``metas``: to the end of its last tensor."""
    return max((m.offset + m.nbytes for m in metas), default=0)


def gap_ranges(metas: Iterable[TensorMeta], total: int) -> tuple[tuple[int, int], ...]:
    """The byte ranges ``(start, length)`` of a bucket of ``total`` bytes laid out as ``metas`` that no tensor
    covers (alignment): before, between and after its tensors, in offset order, none empty."""
    out, end = [], 0
    for start, stop in sorted((m.offset, m.offset + m.nbytes) for m in metas):
        if start > end:
            out.append((end, start - end))
        end = max(end, stop)
    if total > end:
        out.append((end, total - end))
    return tuple(out)


def view_tensor(buffer: Tensor, meta: TensorMeta) -> Tensor:
    """The tensor ``meta`` describes, as a view into ``buffer`` (a flat uint8 tensor)."""
    return buffer.narrow(0, meta.offset, meta.nbytes).view(meta.dtype).view(meta.shape)


def typed_buffer(nbytes: int, device: torch.device | str) -> Tensor:
    """A flat uint8 buffer of at least ``nbytes`` that views as any dtype (its size rounded up to 16)."""
    return torch.empty(round_up(max(nbytes, 1), 16), dtype=torch.uint8, device=device)


def typed_runs(entries: Iterable[tuple[torch.dtype, int, int, Any]]) -> list[tuple[torch.dtype, list[int], list]]:
    """How to cut many tensors out of one flat buffer with one split per dtype. ``entries``:
    ``(dtype, byte offset, numel, payload)``, each offset a multiple of its element size. Per dtype, in
    offset order: the split sizes in elements (gap, tensor, gap, tensor, ...) and the payloads."""
    by_dtype: dict[torch.dtype, list[tuple[int, int, Any]]] = {}
    for dtype, offset, numel, payload in entries:
        by_dtype.setdefault(dtype, []).append((offset // dtype.itemsize, numel, payload))
    runs = []
    for dtype, items in by_dtype.items():
        items.sort(key=lambda e: e[0])
        sizes, pos = [], 0
        for off, n, _ in items:
            sizes += [off - pos, n]
            pos = off + n
        runs.append((dtype, sizes, [payload for _, _, payload in items]))
    return runs


def typed_views(raw: Tensor, dtype: torch.dtype, sizes: list[int]) -> tuple[Tensor, ...]:
    """The flat tensors of one run of :func:`typed_runs`, as views of ``raw`` (a :func:`typed_buffer`)."""
    typed = raw.view(dtype)
    return typed.split_with_sizes([*sizes, typed.numel() - sum(sizes)])[1::2]


@dataclass(slots=True)
class Bucket:
    """Flat buffer + metadata. ``named_tensors()`` gives ``(hf_name, tensor)`` views (no copies)."""

    index: int
    buffer: Tensor  # uint8, 1-D
    metas: tuple[TensorMeta, ...]
    kept: bool = False  # the buffer is one the stream keeps and packs again (a receiver may keep it mapped)
    written: bool = False  # the tensors went straight into the receiver's memory (write_into): no bytes here
    # A delta update's bucket: ``buffer`` is the payload, encoded as the header says against the bytes the
    # engine holds of this bucket (:mod:`weightstream.streaming.delta`); ``metas`` lay out the decoded bytes.
    delta: DeltaHeader | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def word(self) -> int:
        """The word a delta compares this bucket in (:func:`~weightstream.streaming.delta.word_size`)."""
        return word_size(self.nbytes, (m.dtype.itemsize for m in self.metas))

    def __len__(self) -> int:
        return len(self.metas)

    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for meta in self.metas:
            yield meta.name, view_tensor(self.buffer, meta)

    def flattened_metadata(self) -> list[dict]:
        """The bucket's metadata as SGLang's flattened bucket spells it (byte offsets)."""
        return [
            {
                "name": m.name,
                "shape": list(m.shape),
                "dtype": dtype_name(m.dtype),
                "start_idx": m.offset,
                "end_idx": m.offset + m.nbytes,
                "numel": m.numel,
            }
            for m in self.metas
        ]

    @classmethod
    def pack(
        cls,
        named: Sequence[tuple[str, Tensor]],
        *,
        index: int = 0,
        device: torch.device | str | None = None,
        align: int = ALIGN,
    ) -> Bucket:
        """Copy ``named`` tensors into one new flat buffer."""
        if not named:
            raise ValueError("cannot pack an empty bucket")
        offsets, total = layout([[t.numel() * t.element_size()] for _, t in named], align)
        device = device if device is not None else named[0][1].device
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        metas = []
        end = 0
        for (name, t), (off,) in zip(named, offsets, strict=True):
            meta = TensorMeta(name, t.dtype, tuple(t.shape), off)
            buffer.narrow(0, end, off - end).zero_()  # the alignment gap: the same bytes on every pack
            view_tensor(buffer, meta).copy_(t)
            metas.append(meta)
            end = off + meta.nbytes
        buffer.narrow(0, end, total - end).zero_()
        return cls(index, buffer, tuple(metas))

    @classmethod
    def from_metadata(cls, buffer: Tensor, metadata: Iterable[dict], *, index: int = 0) -> Bucket:
        """Rebuild a bucket from a received buffer and SGLang-style flattened metadata."""
        from weightstream.models.spec import dtype_from_name

        metas = []
        for item in metadata:
            meta = TensorMeta(item["name"], dtype_from_name(item["dtype"]), tuple(item["shape"]),
                              int(item["start_idx"]))
            if meta.offset + meta.nbytes != int(item["end_idx"]) or meta.offset + meta.nbytes > buffer.numel():
                raise ValueError(f"bucket metadata for {meta.name!r} does not fit the buffer")
            metas.append(meta)
        return cls(index, buffer, tuple(metas))
