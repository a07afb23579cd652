"""Copy programs: how each bucket is filled, prepared once per plan (its layout, the views of live tensors it is
copied from, what is converted one by one), and the batched copies a program makes into a bucket buffer or straight
into a receiver's tensors, block FP8 casts among them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from weightstream.converters.ops import OpContext, hf_views
from weightstream.streaming.bucket import TensorMeta, gap_ranges, typed_runs, typed_views, view_tensor
from weightstream.streaming.copies import WordCheck, batched_copy
from weightstream.streaming.fp8_cast import CastJob, row_layout
from weightstream.streaming.items import StreamItem
from weightstream.streaming.quantize import block_cast
from weightstream.streaming.value_checks import KINDS, PieceCheck, kind_of, tensor_pieces
from weightstream.wire.fp8 import BlockFP8

__all__ = ["ItemView", "CopyProgram", "item_views", "make_program", "buffer_copies", "zero_gaps", "target_copies",
           "target_check", "MAX_SLABS", "MIN_SLAB_BYTES",
           "contiguous_slabs"]


# A batched HF tensor: the view of a live tensor it is made from, its metadata, and its scales' where it leaves as
# block FP8.
ItemView = tuple[Tensor, TensorMeta, TensorMeta | None]


@dataclass(slots=True)
class CopyProgram:
    """How one bucket is filled, prepared once: its layout and the views to copy from."""

    total: int  # bytes of the bucket
    metas: tuple[TensorMeta, ...]
    nbytes: int  # bytes of its tensors (the buffer less the alignment gaps)
    items: list[StreamItem]  # in layout order
    item_metas: list[list[TensorMeta]]
    # Batched copies: per dtype, how to cut the buffer (typed_runs) and the flat source views.
    runs: list[tuple[torch.dtype, list[int], list[Tensor]]]
    strided: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, Tensor]]  # non-contiguous sources
    slow: list[int]  # items converted one by one (TP-gathered, or an op that makes new tensors)
    batched: int
    spans: list[tuple[int, int | None, int, int]]  # per item (PP owner, EP owner, first byte, end): Source.share
    # Every batched tensor: (HF name, dtype, the view of a live tensor it is copied from), for ``write_into``.
    named: list[tuple[str, torch.dtype, Tensor]]
    # Every batched tensor that leaves as block FP8: (the view it is quantized from, its values', its scales' metadata).
    casts: list[tuple[Tensor, TensorMeta, TensorMeta]]
    # The bytes no tensor covers (alignment), (start, length): zeroed on every pack into a kept buffer.
    gaps: tuple[tuple[int, int], ...]
    # With kept buffers: the batched copies, made once per kept buffer (key: its address); with
    # ``write_into``: the copies into a receiver's tensors (key: ("into", the receiver's key)).
    copies: dict[Any, list[Callable[[], Any]]] = field(default_factory=dict)
    # With ``write_into`` and a flag: the check of what those copies did not look at (same key), run once written.
    checks: dict[Any, Callable[[], Any]] = field(default_factory=dict)


def item_views(it: StreamItem, metas: Sequence[TensorMeta], source: Tensor | None,
               context: OpContext) -> list[ItemView] | None:
    """Per HF tensor of the item: the view of the live parameter ``source`` it is copied (or quantized) from, its
    metadata, and its scales' where it leaves as block FP8; None where the tensors are not views of the
    parameter (no ``source``: gathered over TP; or an op that computes new tensors)."""
    if source is None:
        return None
    op = it.entry.resolved.mapping.op
    try:
        views = hf_views(op, source, context)
    except Exception:  # noqa: BLE001 -- converted one by one, where the error is raised as it always was
        return None
    flags = it.quantized or (False,) * len(views)
    if len(flags) != len(views) or len(metas) != len(views) + sum(flags):
        return None
    out: list[ItemView] = []
    base, k = source.untyped_storage().data_ptr(), 0
    for view, quantized in zip(views, flags, strict=True):
        meta, scale = metas[k], (metas[k + 1] if quantized else None)
        k += 2 if quantized else 1
        if (view.numel() != meta.numel or view.device != source.device
                or view.untyped_storage().data_ptr() != base or (row_layout(view) is None if quantized else
                                                                 view.dtype != meta.dtype)):
            return None
        out.append((view, meta, scale))
    return out


def make_program(items: list[StreamItem], metas: list[list[TensorMeta]], total: int,
                 views_of: Callable[[StreamItem, list[TensorMeta]], list[ItemView] | None]) -> CopyProgram:
    """The copy program of a bucket of ``items`` laid out as ``metas`` (``total`` bytes); ``views_of``: an item's
    views of live tensors (:func:`item_views`), None where it is converted one by one."""
    flat: list[tuple[torch.dtype, int, int, Tensor]] = []
    named: list[tuple[str, torch.dtype, Tensor]] = []
    strided: list = []
    casts: list[tuple[Tensor, TensorMeta, TensorMeta]] = []
    slow: list[int] = []
    batched = 0
    for k, (it, item_metas) in enumerate(zip(items, metas, strict=True)):
        if not it.mine:
            continue
        views = views_of(it, item_metas)
        if views is None:
            slow.append(k)
            continue
        for view, meta, scale in views:
            batched += 1
            if scale is not None:
                casts.append((view, meta, scale))
                continue
            named.append((meta.name, meta.dtype, view))
            _place(view, meta, flat, strided)
    flat_metas = tuple(m for ms in metas for m in ms)
    spans = [(it.entry.pp_owner, it.entry.ep_owner, ms[0].offset, ms[-1].offset + ms[-1].nbytes)
             for it, ms in zip(items, metas, strict=True) if ms]
    return CopyProgram(total, flat_metas, sum(m.nbytes for m in flat_metas), items, metas,
                       typed_runs(_coalesced(flat)), strided, slow, batched, spans, named, casts,
                       gap_ranges(flat_metas, total))


MAX_SLABS = 4096  # contiguous pieces a strided view is copied as, at most (else one strided copy)
MIN_SLAB_BYTES = 64 << 10  # nor pieces smaller than this: a strided copy moves short runs better


def contiguous_slabs(view: Tensor, limit: int = MAX_SLABS, min_bytes: int = MIN_SLAB_BYTES) -> list[Tensor] | None:
    """``view`` as contiguous pieces in its dense order (cut along its leading dims until each piece is contiguous:
    the query, key and value rows of each group of a fused QKV parameter), or None where that takes more than
    ``limit`` pieces, one smaller than ``min_bytes``, or some innermost piece is not contiguous."""
    if view.is_contiguous():
        return [view]
    if view.dim() < 2 or view.shape[0] > limit or view[0].numel() * view.element_size() < min_bytes:
        return None
    out: list[Tensor] = []
    for part in view.unbind(0):
        got = contiguous_slabs(part, limit - len(out), min_bytes)
        if got is None:
            return None
        out += got
    return out


def _place(view: Tensor, meta: TensorMeta, flat: list[tuple[torch.dtype, int, int, Tensor]], strided: list) -> None:
    """A batched copy of ``view`` into ``meta``'s place in the bucket: flat ones where the view is contiguous or
    cut into contiguous slabs (:func:`contiguous_slabs`), else a strided one (the bucket's side as a dense view of the
    view's shape)."""
    size = meta.dtype.itemsize
    if meta.offset % size:
        raise AssertionError(f"{meta.name} at byte {meta.offset} is not aligned to {size}")
    slabs = contiguous_slabs(view)
    if slabs is not None:
        offset = meta.offset
        for slab in slabs:
            flat.append((meta.dtype, offset, slab.numel(), slab.view(-1)))
            offset += slab.numel() * size
        return
    strides, acc = [], 1
    for d in reversed(view.shape):
        strides.append(acc)
        acc *= d
    strided.append((meta.dtype, tuple(view.shape), tuple(reversed(strides)), meta.offset // size, view))


def buffer_copies(program: CopyProgram, raw: Tensor, fp8: BlockFP8 | None, kept: bool) -> list[Callable[[], Any]]:
    """The batched copies of ``program`` into the bucket buffer ``raw``: per dtype, the flat copies in one call,
    and the strided copies in one. ``_foreach_copy_`` takes one list of one dtype and dense pairs in a few fused
    launches (a single other pair sends the whole list down one copy per tensor); where the buffer is kept
    (``kept``: its addresses stay) on a GPU, a :class:`PieceCopy` does the flat copies of a dtype in one
    launch. ``fp8``: the block FP8 casts too. A kept buffer holds what the last bucket packed into it left, so
    its first call zeroes this bucket's alignment gaps (:func:`zero_gaps`): only bytes no tensor covers."""
    calls = [batched_copy(list(typed_views(raw, dtype, sizes)), sources, stable=kept)
             for dtype, sizes, sources in program.runs]
    if program.strided:
        calls.append(partial(torch._foreach_copy_, [raw.view(dtype).as_strided(shape, strides, offset)
                                                    for dtype, shape, strides, offset, _ in program.strided],
                             [source for *_, source in program.strided]))
    if program.casts and fp8 is not None:
        calls.append(block_cast([CastJob(view, view_tensor(raw, meta), view_tensor(raw, scale))
                                 for view, meta, scale in program.casts], fp8))
    if kept and program.gaps:
        calls.insert(0, zero_gaps(program.gaps, raw))
    return calls


def zero_gaps(gaps: Sequence[tuple[int, int]], raw: Tensor) -> Callable[[], Any]:
    """The byte ranges ``gaps`` (``(start, length)``, :attr:`CopyProgram.gaps`) of ``raw`` zeroed in one call
    (``_foreach_zero_`` over views made now: on a GPU a few fused launches on the current stream)."""
    return partial(torch._foreach_zero_, [raw.narrow(0, start, length) for start, length in gaps])


def target_copies(program: CopyProgram, into: dict[str, Tensor], fp8: BlockFP8 | None,
                  flag: Tensor | None = None) -> tuple[list[Callable[[], Any]], list[tuple[str, Tensor]]]:
    """The batched copies of ``program`` straight into a receiver's tensors ``into`` (by HF name): per dtype the
    contiguous copies in one call (runs back to back in a source and in a target made one copy), and the strided
    ones in one. ``fp8``: values and scales cast into the receiver's own. ``flag`` (an int32 on the device; given
    where :func:`~weightstream.streaming.copies.available` with ``checked``): the contiguous copies of a float dtype
    look at what they copy for NaN and infinities as they copy, raising it. Returned with the calls: the tensors
    written that no copy looked at (by HF name), for the caller to check once written (:func:`target_check`)."""
    flat: dict[torch.dtype, list[tuple[str, Tensor, Tensor]]] = {}
    strided: list[tuple[str, Tensor, Tensor]] = []
    for name, dtype, view in program.named:
        target = into[name]
        slabs = contiguous_slabs(view)
        if slabs is None:
            strided.append((name, target.view(view.shape), view))
            continue
        at = 0
        for slab in slabs:  # the target's dense order: each slab its next elements
            flat.setdefault(dtype, []).append((name, target.view(-1).narrow(0, at, slab.numel()), slab.view(-1)))
            at += slab.numel()
    calls: list[Callable[[], Any]] = []
    unchecked = [(name, into[name]) for name, _, _ in strided]
    for dtype, named in flat.items():
        kind = _word_kind(dtype, [name for name, _, _ in named]) if flag is not None else None
        if flag is not None and kind is None:
            unchecked += list({name: into[name] for name, _, _ in named}.items())  # (a name per slab)
        dst, src = zip(*_joined([(d, s) for _, d, s in named]), strict=True)
        check = None if kind is None or flag is None else WordCheck(kind, flag)
        calls.append(batched_copy(list(dst), list(src), stable=True, check=check))
    if strided:
        calls.append(partial(torch._foreach_copy_, [d for _, d, _ in strided], [s for _, _, s in strided]))
    if program.casts and fp8 is not None:
        calls.append(block_cast([CastJob(view, into[meta.name].view(meta.shape), into[scale.name])
                                 for view, meta, scale in program.casts], fp8))
        unchecked += [(m.name, into[m.name]) for _, meta, scale in program.casts for m in (meta, scale)]
    return calls, unchecked


def _word_kind(dtype: torch.dtype, names: Sequence[str]) -> int | None:
    """The value kind a checked copy of tensors ``names`` of ``dtype`` looks for, word by word: the dtype's own where
    it has one and none of them is a block-FP8 scale (whose check is not a word's bits); else None."""
    kind = KINDS.get(dtype)
    return kind if kind is not None and all(kind_of(dtype, name) == kind for name in names) else None


def target_check(named: Sequence[tuple[str, Tensor]], flag: Tensor) -> Callable[[], Any]:
    """One launch that looks at ``named`` (a receiver's tensors, once written) for what an engine checks an update
    for, raising ``flag`` (:class:`~weightstream.streaming.value_checks.PieceCheck`)."""
    pieces = tensor_pieces(named)
    if pieces is None:
        raise ValueError("a tensor of a float dtype the value check does not know: "
                         f"{[n for n, t in named if t.dtype.is_floating_point and t.dtype not in KINDS]}")
    return PieceCheck(pieces, flag)


def _coalesced(flat: list[tuple[torch.dtype, int, int, Tensor]]) -> list[tuple[torch.dtype, int, int, Tensor]]:
    """``flat`` copies (dtype, byte offset in the bucket, numel, flat source view) with every run of copies
    that are back to back in the bucket *and* in one source storage made one copy (gate and up of one
    parameter; neighbouring parameters of a contiguous parameter buffer, such as Megatron's DDP buffer)."""
    out: list[tuple[torch.dtype, int, int, Tensor]] = []
    for dtype, offset, numel, src in sorted(flat, key=lambda e: (str(e[0]), e[1])):
        if out:
            pdtype, poffset, pnumel, psrc = out[-1]
            if (pdtype == dtype and poffset + pnumel * dtype.itemsize == offset
                    and psrc.untyped_storage()._cdata == src.untyped_storage()._cdata
                    and psrc.data_ptr() + pnumel * dtype.itemsize == src.data_ptr()):
                out[-1] = (dtype, poffset, pnumel + numel, psrc.as_strided((pnumel + numel,), (1,),
                                                                           psrc.storage_offset()))
                continue
        out.append((dtype, offset, numel, src))
    return out


def _joined(pairs: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """Flat (target, source) copy pairs of one dtype, with every run that is back to back in one target
    storage and in one source storage made one pair (gate and up of one expert; the experts of a layer)."""
    out: list[tuple[Tensor, Tensor]] = []
    for dst, src in pairs:
        if out:
            pdst, psrc = out[-1]
            nbytes = pdst.numel() * pdst.element_size()
            if (pdst.data_ptr() + nbytes == dst.data_ptr() and psrc.data_ptr() + nbytes == src.data_ptr()
                    and pdst.untyped_storage()._cdata == dst.untyped_storage()._cdata
                    and psrc.untyped_storage()._cdata == src.untyped_storage()._cdata):
                n = pdst.numel() + dst.numel()
                out[-1] = (pdst.as_strided((n,), (1,), pdst.storage_offset()),
                           psrc.as_strided((n,), (1,), psrc.storage_offset()))
                continue
        out.append((dst, src))
    return out

