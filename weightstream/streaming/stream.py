"""``stream_hf_weights``: a model's weights as lazy, bounded buckets of HF tensors.

Flow for one call (on every rank of the job):

1. source (:mod:`weightstream.sources`): the global table (same on all ranks) and this
   rank's live tensors: a Megatron-Core model, an FSDP2/DTensor model, or a Megatron checkpoint on disk;
2. plan: buckets of at most ``bucket_bytes``, and for each bucket its copy program;
3. per bucket, lazily: what the converter reads for the tensors this rank makes is taken as a view of a
   live tensor, or fetched from the source (one batched all-gather per group; read from disk); each is
   converted and packed into the flat buffer; then the source shares each rank's part of the bucket
   with the others (Megatron: over the EP and PP groups).

Steps 1-2 are made once and kept (:class:`StreamPlan`, cached per model): a later call on the same
model, config, converter, parallel layout and bucket settings reuses them after checking, in a
few milliseconds, that no parameter was replaced, moved to new storage, added or removed (all ranks
agree through one all-reduce). Packing is then batched: the converted tensors are views of the live
parameters, prepared once, and each bucket is filled with one batched copy per dtype (``_foreach_copy_``,
or on a GPU one launch of :mod:`~weightstream.streaming.copies` into a kept buffer).

Mixture of experts: routed experts always carry their global index (``mlp.experts.{E}``, with
``E = ep_rank * experts_per_rank + e``). In full mode every rank yields every expert, gathered over expert-TP
and broadcast from its EP owner within the bucket. In per_rank mode there is no EP traffic: each rank yields
only the experts its own EP rank holds (cut by its expert-TP rank, the :class:`Shard` giving the placement),
plus the non-expert tensors (cut by its dense TP rank). This serves an engine whose expert parallelism equals
the trainer's: engine EP rank r loads the experts that trainer EP rank r yields, under the same global ids,
and takes the non-expert tensors from any one EP rank (they are the same on all); an engine with another
expert layout needs full mode.

A receiver whose memory this process can write (a colocated engine's own weights, mapped through CUDA IPC)
may take the tensors there instead of in bucket buffers (:meth:`BucketStream.write_into`): the same batched
copies, with the receiver's tensors as their targets.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from weightstream.common.cyclic_gc import no_cyclic_gc
from weightstream.common.layout import ALIGN, layout
from weightstream.converters.expected import hf_model_shapes
from weightstream.converters.fp8 import BlockFP8
from weightstream.converters.mapping import Converter
from weightstream.converters.ops import OpContext, convert_into, hf_views
from weightstream.converters.registry import get_converter, model_spec
from weightstream.errors import ConversionError
from weightstream.models.spec import ModelSpec, load_hf_config
from weightstream.sources import as_source
from weightstream.sources.base import CollectiveCounts, Mode, ModuleGuard, Source, first_device
from weightstream.sources.names import WEIGHT_BUFFERS
from weightstream.sources.table import HFOut, TensorEntry
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import (
    Bucket,
    Shard,
    TensorMeta,
    typed_buffer,
    typed_runs,
    typed_views,
    view_tensor,
)
from weightstream.streaming.copies import batched_copy, warm_kernel
from weightstream.streaming.fp8_cast import CastJob, row_layout, takes_aligned
from weightstream.streaming.fp8_cast import warm_kernel as warm_cast_kernel
from weightstream.streaming.plan import BucketPlan, plan_buckets
from weightstream.streaming.quantize import Quantization, QuantizeBatch, block_cast, convert_quantized

__all__ = [
    "DEFAULT_BUCKET_BYTES", "StreamStats", "StreamPlan", "BucketStream", "stream_hf_weights", "clear_plans",
    "entry_mode"
]


DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass
class StreamStats(CollectiveCounts):
    """Counters of one stream, filled as buckets are produced (and the source's collectives)."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    peak_staging_bytes: int = 0  # largest (output buffer + gather buffers + conversion temp) at once
    setup_seconds: float = 0.0  # metadata exchange, checks and planning (or checking the kept plan)
    seconds: float = 0.0  # producing the buckets
    planned: bool = False  # this stream made its plan (False: it reused a kept one)
    batched: int = 0  # tensors packed by the batched copies
    copies: int = 0  # copies those take (tensors back to back in the bucket and in one storage: one copy)
    unbatched: int = 0  # tensors converted one by one (TP-gathered tensors, ops that make new tensors)
    copy_programs: int = 0  # buckets whose batched copies this stream made (0: every bucket's were kept)


@dataclass
class _Item:
    entry: TensorEntry
    outputs: tuple[HFOut, ...]  # what this rank emits for the entry
    shards: tuple[Shard | None, ...]
    mine: bool  # this rank holds (a shard of) it
    quantized: tuple[bool, ...] = ()  # per HF tensor of the op, whether it leaves as block FP8 (empty: none)


# A batched HF tensor: the view of a live tensor it is made from, its metadata, and its scales' where it leaves as
# block FP8.
_View = tuple[Tensor, TensorMeta, TensorMeta | None]


@dataclass(slots=True)
class _Program:
    """How one bucket is filled, prepared once: its layout and the views to copy from."""

    total: int  # bytes of the bucket
    metas: tuple[TensorMeta, ...]
    nbytes: int  # bytes of its tensors (the buffer less the alignment gaps)
    items: list[_Item]  # in layout order
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
    # With kept buffers: the batched copies, made once per kept buffer (key: its address); with
    # ``write_into``: the copies into a receiver's tensors (key: ("into", the receiver's key)).
    copies: dict[Any, list[Callable[[], Any]]] = field(default_factory=dict)


@dataclass
class StreamPlan:
    """What a stream of one model needs before any data moves, made once and kept (under a key of the
    model, config, converter, layout and bucket settings): the global table, the bucket plan, and per
    bucket its copy program (made when the bucket is first produced)."""

    buckets: list[BucketPlan]
    items: list[_Item]
    source: Source  # the source that made the table: it holds this rank's live tensors
    device: torch.device
    guard: ModuleGuard | None
    quantization: Quantization | None = None
    programs: dict[int, _Program] = field(default_factory=dict)
    buffers: list[Tensor | None] = field(default_factory=lambda: [None, None])  # kept bucket buffers (reuse)
    digest: str | None = None  # of every bucket's metadata (metadata_digest)
    checked_into: Any = None  # the key of the last write_into targets checked against every bucket
    all_mine: bool | None = None  # this rank makes every tensor itself (read once: can_write_into)

    def forget_copies(self, key: Any) -> None:
        """Drop every bucket's copies kept under ``key`` (``("into", k)``: those into the targets ``k`` of
        :meth:`BucketStream.write_into`, which hold views of them)."""
        for program in self.programs.values():
            program.copies.pop(key, None)


@dataclass
class BucketStream(Iterator[Bucket]):
    """An iterator of :class:`Bucket`; ``len()`` is the number of buckets it will yield."""

    spec: ModelSpec
    mode: Mode
    topology: Topology
    source: Source
    plan: list[BucketPlan]
    items: list[_Item]
    device: torch.device
    align: int = ALIGN
    stats: StreamStats = field(default_factory=StreamStats)
    quantization: Quantization | None = None  # block FP8 for the tensors the family declares
    shared: StreamPlan | None = None
    reuse_buffers: bool = False
    _gen: Iterator[Bucket] | None = None
    _programs: dict[int, _Program] = field(default_factory=dict)  # without a kept plan
    # Which buckets to make (None: all). Only for a source whose ranks make their buckets without each other
    # (``source.independent``): ranks that skip different buckets would leave each other's collectives waiting.
    select: Any = None
    # ``write_into``: the receiver's tensors by HF name, written straight into (no bucket buffer), and their key.
    _into: dict[str, Tensor] | None = None
    _into_key: Any = None

    def __len__(self) -> int:
        return len(self.plan)

    @property
    def total_bytes(self) -> int:
        return sum(o.nbytes for it in self.items for o in it.outputs)

    @property
    def num_tensors(self) -> int:
        return sum(len(it.outputs) for it in self.items)

    def __iter__(self) -> BucketStream:
        return self

    def __next__(self) -> Bucket:
        if self._gen is None:
            self._gen = self._produce()
        return next(self._gen)

    # -- production -------------------------------------------------------------------------

    def selected(self) -> int:
        """How many buckets this stream will yield."""
        return len(self.plan) if self.select is None else sum(1 for bp in self.plan if self.select(bp.index))

    def _produce(self) -> Iterator[Bucket]:
        if self.select is not None and not self.source.independent:
            raise ValueError("only a source whose ranks work independently (a checkpoint on disk) can skip buckets")
        for bp in self.plan:
            if self.select is not None and not self.select(bp.index):
                continue
            start = time.perf_counter()
            program = self._program_for(bp.index)
            bucket = self._build(bp, program) if self._into is None else self._build_into(bp, program, self._into)
            self.stats.seconds += time.perf_counter() - start
            self.stats.buckets += 1
            self.stats.tensors += len(bucket.metas)
            self.stats.bytes += program.nbytes
            yield bucket

    def _layout(self, items: list[_Item]) -> tuple[list[_Item], list[list[TensorMeta]], int]:
        """Where each tensor of ``items`` goes in the bucket buffer.

        With ``align`` >= 8 every tensor starts on an ``align`` boundary. With a smaller ``align``
        (``1``: SGLang's dense flattened bucket, back to back) items are ordered by element size,
        largest first, so that every tensor still starts at a multiple of its own element size.
        """
        if self.align < 8:
            items = sorted(items, key=lambda it: -it.entry.dtype.itemsize)
        offsets, total = layout([[o.nbytes for o in it.outputs] for it in items], self.align)
        metas = [
            [TensorMeta(o.name, o.dtype, o.shape, off, sh)
             for o, off, sh in zip(it.outputs, offs, it.shards, strict=True)]
            for it, offs in zip(items, offsets, strict=True)
        ]
        return items, metas, total

    def bucket_metas(self, index: int) -> tuple[TensorMeta, ...]:
        """The metadata of bucket ``index`` as this rank will yield it, before it is made (its copy
        program is made now if it was not yet; no communication)."""
        return self._program_for(index).metas

    def metadata_digest(self) -> str:
        """A digest of every bucket's metadata as this rank yields it (names, dtypes, shapes, offsets, shards),
        made once per kept plan: a receiver that has seen it already knows the layout of every bucket."""
        if self.shared is not None and self.shared.digest is not None:
            return self.shared.digest
        h = hashlib.sha256()
        for i in range(len(self.plan)):
            h.update(repr([(m.name, str(m.dtype), m.shape, m.offset, m.shard) for m in self.bucket_metas(i)]).encode())
            h.update(b"|")
        digest = h.hexdigest()
        if self.shared is not None:
            self.shared.digest = digest
        return digest

    @property
    def _kept_plan(self) -> StreamPlan | None:
        """The kept plan whose two buffers buckets are packed into (``reuse_buffers``, with a kept plan); None
        where each bucket gets a new buffer."""
        return self.shared if self.reuse_buffers else None

    @property
    def _keeps_buffers(self) -> bool:
        """Buckets are packed into the two buffers kept with the plan (``reuse_buffers``, with a kept plan)."""
        return self._kept_plan is not None

    def kept_buffers(self) -> list[Tensor]:
        """The buffers this stream packs buckets into again and again (``reuse_buffers``), allocated now if
        they were not."""
        kept = self._kept_plan
        if kept is None:
            return []
        for bp in self.plan[:2]:
            self._buffer(bp, self._program_for(bp.index).total)
        return [b for b in kept.buffers if b is not None]

    def prepare_copies(self) -> None:
        """With kept buffers: allocate them and make every bucket's batched copies into its buffer now; with
        :meth:`write_into`: make the copies into the targets now (on a GPU, either way, the copy kernel
        compiled and its address tables uploaded), so that the first stream costs about what a later one
        does."""
        if self._into is not None:
            for bp in self.plan:
                self._copies_into(self._program_for(bp.index), self._into)
        elif self._keeps_buffers:
            for bp in self.plan:
                program = self._program_for(bp.index)
                self._copies(program, self._buffer(bp, program.total))
        else:
            return
        warm_kernel(self.device)

    def warm_casts(self) -> None:
        """With block FP8 on a GPU: the cast kernel compiled in the forms this plan's batched casts take (what the
        first pack would compile, a second or more), packing nothing."""
        if self.quantization is None:
            return
        fp8 = self.quantization.fp8
        forms = {(view.dtype, takes_aligned(view, meta.shape, meta.offset, fp8))
                 for bp in self.plan for view, meta, _ in self._program_for(bp.index).casts}
        warm_cast_kernel(forms, fp8, self.device)

    def rehearse(self) -> None:
        """Pack every bucket once and deliver none (the next update packs them again): what a first pack compiles
        or touches for the first time (on a GPU, the block-FP8 kernel's variants; the allocator's blocks) is then
        done. Every rank of the stream rehearses together (the gathers need each). Not where the stream writes
        straight into an engine's weights (:meth:`write_into`), which only an update may change."""
        if self._into is not None:
            raise RuntimeError("a stream that writes into an engine's weights is not rehearsed")
        for _ in self:
            pass

    def can_write_into(self) -> bool:
        """Whether this rank makes every tensor of every bucket itself, whole (a full stream of a source with
        no pipeline or expert parallelism to share over, kept plan): then :meth:`write_into` applies."""
        if self.mode != "full" or self.shared is None:
            return False
        if self.shared.all_mine is None:  # per plan, not per update: the items are the plan's
            self.shared.all_mine = all(it.mine for it in self.items)
        return self.shared.all_mine

    def write_into(self, targets: dict[str, Tensor], key: Any) -> None:
        """Have every tensor written straight into ``targets[name]`` (a contiguous tensor of the tensor's dtype
        and size: a receiver's own weight, mapped into this process) instead of into a bucket buffer. The
        buckets this stream then yields carry their metadata and no bytes (``Bucket.written``). ``key``
        names the targets: the copies into them are made once per plan and key, so the key must change
        whenever a target moves. One error lists every tensor ``targets`` lacks or cannot hold."""
        shared = self.shared
        if shared is None or not self.can_write_into():
            raise ValueError("write_into needs a full stream in which this rank makes every tensor (no pipeline or "
                             "expert parallelism to share buckets over) with a kept plan")
        if shared.checked_into == key:  # checked when these targets were first given
            self._into, self._into_key = targets, ("into", key)
            return
        problems = []
        for bp in self.plan:
            for m in self._program_for(bp.index).metas:
                t = targets.get(m.name)
                if t is None:
                    problems.append(f"{m.name}: no target")
                elif t.dtype != m.dtype or t.numel() != m.numel or not t.is_contiguous() or t.device != self.device:
                    problems.append(f"{m.name}: target is {t.dtype} x {t.numel()} on {t.device}"
                                    f"{'' if t.is_contiguous() else ', not contiguous'}; the tensor is {m.dtype} x "
                                    f"{m.numel} on {self.device}")
        if problems:
            raise ValueError(f"{len(problems)} tensors cannot be written into the targets: " + "; ".join(problems))
        self._into, self._into_key = targets, ("into", key)
        shared.checked_into = key

    def _program_for(self, index: int) -> _Program:
        """Bucket ``index``'s copy program, made on first use and kept with the plan."""
        programs = self.shared.programs if self.shared is not None else self._programs
        program = programs.get(index)
        if program is None:
            program = programs[index] = self._program(self.plan[index])
        return program

    def metas_for_rank(self, index: int, tp_rank: int) -> list[TensorMeta]:
        """The metadata of bucket ``index`` as TP rank ``tp_rank`` makes it (per_rank mode: the shards
        differ by rank), computed locally, without communication."""
        topo = replace(self.topology, tp_rank=tp_rank, etp_rank=tp_rank if self.topology.etp_size > 1 else 0)
        items = [_item(self.items[i].entry, self.spec, topo, self.mode, self.quantization)[0]
                 for i in self.plan[index].items]
        _, metas, _ = self._layout(items)
        return [m for ms in metas for m in ms]

    def _context(self, it: _Item) -> OpContext:
        if entry_mode(it.entry, self.mode) == "full":
            return OpContext(self.spec, parts=it.entry.parts)
        return OpContext(self.spec, parts=1, shard_rank=self._group_rank(it.entry))

    def _views(self, it: _Item, metas: Sequence[TensorMeta]) -> list[_View] | None:
        """Per HF tensor of the item: the view of the live parameter it is copied (or quantized) from, its
        metadata, and its scales' where it leaves as block FP8; None where the tensors are not views of the
        parameter (gathered over TP, or an op that computes new tensors)."""
        source = self.source.direct(it.entry, entry_mode(it.entry, self.mode))
        if source is None:
            return None
        op = it.entry.resolved.mapping.op
        try:
            views = hf_views(op, source, self._context(it))
        except Exception:  # noqa: BLE001 -- converted one by one, where the error is raised as it always was
            return None
        flags = it.quantized or (False,) * len(views)
        if len(flags) != len(views) or len(metas) != len(views) + sum(flags):
            return None
        out: list[_View] = []
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

    def _program(self, bp: BucketPlan) -> _Program:
        items, metas, total = self._layout([self.items[i] for i in bp.items])
        flat: list[tuple[torch.dtype, int, int, Tensor]] = []
        named: list[tuple[str, torch.dtype, Tensor]] = []
        strided: list = []
        casts: list[tuple[Tensor, TensorMeta, TensorMeta]] = []
        slow: list[int] = []
        batched = 0
        for k, (it, item_metas) in enumerate(zip(items, metas, strict=True)):
            if not it.mine:
                continue
            views = self._views(it, item_metas)
            if views is None:
                slow.append(k)
                continue
            for view, meta, scale in views:
                batched += 1
                if scale is not None:
                    casts.append((view, meta, scale))
                    continue
                named.append((meta.name, meta.dtype, view))
                size = meta.dtype.itemsize
                if meta.offset % size:
                    raise AssertionError(f"{meta.name} at byte {meta.offset} is not aligned to {size}")
                if view.is_contiguous():
                    flat.append((meta.dtype, meta.offset, meta.numel, view.view(-1)))
                else:
                    strides, acc = [], 1
                    for d in reversed(view.shape):
                        strides.append(acc)
                        acc *= d
                    strided.append((meta.dtype, tuple(view.shape), tuple(reversed(strides)), meta.offset // size, view))
        flat_metas = tuple(m for ms in metas for m in ms)
        spans = [(it.entry.pp_owner, it.entry.ep_owner, ms[0].offset, ms[-1].offset + ms[-1].nbytes)
                 for it, ms in zip(items, metas, strict=True) if ms]
        return _Program(total, flat_metas, sum(m.nbytes for m in flat_metas), items, metas,
                        typed_runs(_coalesced(flat)), strided, slow, batched, spans, named, casts)

    def _buffer(self, bp: BucketPlan, total: int) -> Tensor:
        """The bucket's flat buffer: a new one, or (``reuse_buffers``) one of two kept with the plan, bucket
        i in buffer ``i % 2``: the consumer is done with bucket i once it asks for bucket i + 2."""
        shared = self._kept_plan
        if shared is None:
            return typed_buffer(total, self.device)
        slot = bp.index % 2
        kept = shared.buffers[slot]
        if kept is None or kept.numel() < total or kept.device != self.device:
            largest = max(self._program_for(b.index).total for b in self.plan)
            # zeroed once: the bytes between tensors (alignment) are then the same on every rank and every run
            kept = shared.buffers[slot] = typed_buffer(largest, self.device).zero_()
        return kept

    def _copies(self, program: _Program, raw: Tensor) -> list[Callable[[], Any]]:
        """The batched copies into ``raw``: per dtype, the flat copies in one call, and the strided copies in
        one. ``_foreach_copy_`` takes one list of one dtype and dense pairs in a few fused launches (a single
        other pair sends the whole list down one copy per tensor); with kept buffers on a GPU, where the
        addresses stay, a :class:`PieceCopy` does the flat copies of a dtype in one launch. Kept with the
        program per kept buffer, so a reused buffer costs no view making at all."""
        key = raw.data_ptr()
        kept = self._keeps_buffers
        made = program.copies.get(key) if kept else None
        if made is not None:
            return made
        self.stats.copy_programs += 1
        calls = [batched_copy(list(typed_views(raw, dtype, sizes)), sources, stable=kept)
                 for dtype, sizes, sources in program.runs]
        if program.strided:
            calls.append(partial(torch._foreach_copy_, [raw.view(dtype).as_strided(shape, strides, offset)
                                                        for dtype, shape, strides, offset, _ in program.strided],
                                 [source for *_, source in program.strided]))
        if program.casts and self.quantization is not None:
            calls.append(block_cast([CastJob(view, view_tensor(raw, meta), view_tensor(raw, scale))
                                     for view, meta, scale in program.casts], self.quantization.fp8))
        if kept:
            stale = [k for k in program.copies if isinstance(k, int)]
            if len(stale) >= 2:  # the kept buffers were re-made
                for k in stale:
                    del program.copies[k]
            program.copies[key] = calls
        return calls

    def _copies_into(self, program: _Program, into: dict[str, Tensor]) -> list[Callable[[], Any]]:
        """The batched copies of ``program`` straight into the :meth:`write_into` targets ``into``, made once per
        plan and targets: per dtype the contiguous copies in one call (runs back to back in a source and in
        a target made one copy), and the strided ones in one."""
        made = program.copies.get(self._into_key)
        if made is not None:
            return made
        self.stats.copy_programs += 1
        flat: dict[torch.dtype, list[tuple[Tensor, Tensor]]] = {}
        strided: list[tuple[Tensor, Tensor]] = []
        for name, dtype, view in program.named:
            target = into[name]
            if view.is_contiguous():
                flat.setdefault(dtype, []).append((target.view(-1), view.view(-1)))
            else:
                strided.append((target.view(view.shape), view))
        calls = []
        for pairs in flat.values():
            dst, src = zip(*_joined(pairs), strict=True)
            calls.append(batched_copy(list(dst), list(src), stable=True))
        if strided:
            calls.append(partial(torch._foreach_copy_, [d for d, _ in strided], [s for _, s in strided]))
        if program.casts and self.quantization is not None:  # block FP8: values and scales into the receiver's own
            calls.append(block_cast([CastJob(view, into[meta.name].view(meta.shape), into[scale.name])
                                     for view, meta, scale in program.casts], self.quantization.fp8))
        program.copies[self._into_key] = calls
        return calls

    def _build_into(self, bp: BucketPlan, program: _Program, into: dict[str, Tensor]) -> Bucket:
        """Bucket ``bp`` written straight into the :meth:`write_into` targets ``into``."""
        with no_cyclic_gc():
            for copy in self._copies_into(program, into):
                copy()
        gather_bytes = largest = 0
        batch = None if self.quantization is None else QuantizeBatch(self.quantization.fp8)
        if program.slow:
            items, metas = program.items, program.item_metas
            fetched, gather_bytes = self._fetch([items[k].entry for k in program.slow])
            for k in program.slow:
                it = items[k]
                source = fetched.pop(it.entry.name)
                full = source() if callable(source) else source
                largest = max(largest, full.numel() * full.element_size())
                self._convert(it, full, [into[m.name].view(m.shape) for m in metas[k]], batch)
                del full
        if batch is not None:
            batch.run()
        self._count(program, gather_bytes + largest)
        return Bucket(bp.index, torch.empty(0, dtype=torch.uint8, device=self.device), program.metas, written=True)

    def _fetch(self, entries: list[TensorEntry]) -> tuple[dict[str, Any], int]:
        """What the converter reads for ``entries``, from the source (and the bytes staged for it), each in the
        mode it is made in (:func:`entry_mode`): in per-rank mode a tensor the engines hold whole that this rank
        holds split is gathered, as in full mode (one all-gather per group, the same on every TP rank)."""
        whole = [e for e in entries if entry_mode(e, self.mode) != self.mode]
        fetched, staged = self.source.fetch([e for e in entries if entry_mode(e, self.mode) == self.mode],
                                            self.mode, self.stats)
        if whole:
            gathered, more = self.source.fetch(whole, "full", self.stats)
            fetched.update(gathered)
            staged += more
        return fetched, staged

    def _count(self, program: _Program, staged: int) -> None:
        self.stats.batched += program.batched
        self.stats.copies += sum(len(sources) for _, _, sources in program.runs) + len(program.strided)
        self.stats.unbatched += len(program.slow)
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, staged)

    def _build(self, bp: BucketPlan, program: _Program) -> Bucket:
        items, metas, total = program.items, program.item_metas, program.total
        raw = self._buffer(bp, total)
        buffer = raw.narrow(0, 0, total)
        # Batched: every tensor that is a view of a live parameter, one _foreach_copy_ per dtype.
        with no_cyclic_gc():
            for copy in self._copies(program, raw):
                copy()
        # One by one: TP-gathered tensors (one batched all-gather per group first), and the rest.
        largest = 0
        gather_bytes = 0
        batch = None if self.quantization is None else QuantizeBatch(self.quantization.fp8)
        if program.slow:
            slow = [items[k] for k in program.slow]
            fetched, gather_bytes = self._fetch([it.entry for it in slow if it.mine])
            for k, it in zip(program.slow, slow, strict=True):
                if not it.mine:
                    continue
                source = fetched.pop(it.entry.name)
                full = source() if callable(source) else source
                largest = max(largest, full.numel() * full.element_size())
                targets = [view_tensor(buffer, meta) for meta in metas[k]]
                self._convert(it, full, targets, batch)
                del full, targets
        if batch is not None:
            batch.run()  # every quantized tensor of the bucket at once
        self._count(program, total + gather_bytes + largest)
        self.source.share(buffer, program.spans, self.mode, self.stats)
        return Bucket(bp.index, buffer, program.metas, kept=self._keeps_buffers)

    def _convert(self, it: _Item, full: Tensor, targets: list[Tensor], batch: QuantizeBatch | None) -> None:
        """What the converter reads for ``it``, converted into ``targets`` (quantized where declared: queued in
        ``batch``, which the caller runs once the bucket's tensors are all in)."""
        op = it.entry.resolved.mapping.op
        if batch is not None and self.quantization is not None and any(it.quantized):
            convert_quantized(op, full, self._context(it), it.quantized, targets, batch)
        else:
            convert_into(op, full, self._context(it), targets)

    def _group_rank(self, entry: TensorEntry) -> int:
        return self.topology.group_rank(entry.group)


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


def stream_hf_weights(
    model: nn.Module | Sequence[nn.Module] | Source,
    hf_config: Any,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    mode: Mode = "full",
    align: int = ALIGN,
    topology: Topology | None = None,
    split_dtypes: bool = False,
    reuse_buffers: bool = False,
    quantize: BlockFP8 | None = None,
) -> BucketStream:
    """Stream a model's weights as buckets of HF tensors. Call on every rank.

    ``model``: Megatron-Core model chunks (a ``GPTModel``, possibly wrapped in DDP / Float16Module, or
    the list of VPP chunks); a transformers model (or an ``nn.Module`` with HF names) whose parameters
    are FSDP2 / tensor-parallel DTensors or plain tensors; or any :class:`Source`, such as
    :class:`~weightstream.sources.megatron_checkpoint.MegatronCheckpointSource` for a checkpoint on
    disk. ``hf_config``: a transformers config, a dict with ``model_type``, or a directory.

    ``mode="full"``: each HF tensor whole, on every rank (shards all-gathered once per bucket and
    group, PP stages and EP owners broadcast). ``mode="per_rank"``: no TP gather; TP rank r yields the
    HF shards an engine's TP rank r holds, each with its :class:`Shard` placement.

    Mixture of experts: see the module's doc.

    ``align``: each tensor's start in the bucket buffer is a multiple of it (default 256); ``align=1``
    packs tensors back to back, largest element size first (the layout SGLang's distributed
    receiver computes from names, dtypes and shapes alone).

    ``split_dtypes``: every bucket holds one dtype (for engines whose flat buckets are typed, LMDeploy's):
    the tensors are grouped by dtype (in order within each) and buckets are cut between groups.

    ``reuse_buffers``: buckets are packed into two buffers kept with the plan (bucket i into buffer
    ``i % 2``, with its copy views made once), so a bucket is valid only until bucket i + 2 is asked for: for
    consumers that are done with a bucket by then (every sink is; ``update_weights`` and
    ``save_hf_checkpoint`` use it). The two buffers stay allocated while the plan is kept
    (:func:`clear_plans` frees them).

    The table, checks and plan are made here, eagerly (so a bad model raises now, on every rank
    alike); the buckets are made one at a time as the returned iterator is advanced.
    """
    if mode not in ("full", "per_rank"):
        raise ValueError(f"mode must be 'full' or 'per_rank', got {mode!r}")
    start = time.perf_counter()
    source = as_source(model, topology)
    cfg = load_hf_config(hf_config)
    spec = model_spec(cfg)
    settings = _Settings(mode, bucket_bytes, align, split_dtypes, quantize)
    plan, planned = _kept_or_new_plan(source, cfg, spec, settings)
    modules = bool(list(source.modules()))
    stream = BucketStream(spec=spec, mode=mode, topology=source.topology, source=plan.source, plan=plan.buckets,
                          items=plan.items, device=plan.device, align=align, shared=plan,
                          reuse_buffers=reuse_buffers and modules, quantization=plan.quantization)
    stream.stats.planned = planned
    stream.stats.setup_seconds = time.perf_counter() - start
    return stream


@dataclass(frozen=True)
class _Settings:
    """What a plan depends on besides the model, its config and the parallel layout."""

    mode: Mode
    bucket_bytes: int
    align: int
    split_dtypes: bool
    quantize: BlockFP8 | None = None


def _kept_or_new_plan(source: Source, cfg: Any, spec: ModelSpec, settings: _Settings) -> tuple[StreamPlan, bool]:
    """The plan kept for this model and these settings where every rank still holds it (one vote), else a
    new one (kept for the next stream); and whether it was made now."""
    topo = source.topology
    converter = get_converter(spec.model_type)
    modules = list(source.modules())
    plan: StreamPlan | None = None
    kept: dict[tuple, StreamPlan] = {}
    key = (tuple(map(id, modules)), spec, id(converter), settings, _layout_key(topo))
    if modules:
        kept = _PLANS.get(modules[0], {})
        plan = kept.get(key)
    reuse = plan is not None and plan.guard is not None and plan.guard.holds(modules)
    # Every rank joins the vote (where it has modules); a rank that votes to reuse has a plan.
    device = plan.device if plan is not None else first_device(modules)
    if bool(modules) and _everyone(reuse, topo, device) and plan is not None:
        return plan, False
    plan = _make_plan(source, modules, cfg, spec, converter, settings)
    if modules:
        kept.pop(key, None)
        kept[key] = plan
        while len(kept) > _KEEP:
            kept.pop(next(iter(kept)))
        _PLANS[modules[0]] = kept
    return plan, True


# Plans kept per model (its first module), a few per model (e.g. a full and a per-rank stream).
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, StreamPlan]] = weakref.WeakKeyDictionary()
_KEEP = 4


def clear_plans() -> None:
    """Forget every kept plan (the next stream of each model plans again)."""
    _PLANS.clear()


def _layout_key(topo: Topology) -> tuple:
    groups = (topo.tp_group, topo.pp_group, topo.ep_group, topo.etp_group, topo.world_group)
    return (topo.tp_size, topo.tp_rank, topo.pp_size, topo.pp_rank, topo.ep_size, topo.ep_rank, topo.etp_size,
            topo.etp_rank, tuple(map(id, groups)))


def _everyone(ok: bool, topo: Topology, device: torch.device) -> bool:
    """Whether every rank says ``ok`` (one all-reduce; a single process decides alone)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(topo.world_group) == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=topo.world_group)
    return bool(flag.item())


def _make_plan(source: Source, modules: Sequence[nn.Module], cfg: Any, spec: ModelSpec, converter: Converter,
               settings: _Settings) -> StreamPlan:
    topo, mode = source.topology, settings.mode
    table = source.table(converter, spec, hf_model_shapes(cfg))
    quant = None if settings.quantize is None else Quantization.of(settings.quantize, converter)
    if quant is not None:
        _check_blocks(table, spec, topo, mode, quant)
    items = [_item(e, spec, topo, mode, quant)[0] for e in table
             if mode == "full" or e.ep_owner in (None, topo.ep_rank)]
    keys = None
    if settings.split_dtypes:
        first_seen: dict[torch.dtype, int] = {}
        for it in items:
            first_seen.setdefault(it.entry.dtype, len(first_seen))
        items = sorted(items, key=lambda it: first_seen[it.entry.dtype])  # stable: table order within a dtype
        keys = [it.entry.dtype for it in items]
    planning = [[o.nbytes for o in (it.outputs if mode == "full" else _nominal(it, spec, topo, quant).outputs)]
                for it in items]
    device = source.live_device() or first_device(modules)
    return StreamPlan(
        buckets=plan_buckets(planning, settings.bucket_bytes, settings.align, keys=keys), items=items, source=source,
        device=device,
        guard=ModuleGuard(modules, WEIGHT_BUFFERS) if modules else None, quantization=quant,
    )


def entry_mode(entry: TensorEntry, mode: Mode) -> Mode:
    """The mode ``entry`` is made in by a stream of ``mode``. Per-rank mode yields what each engine TP rank holds:
    a rank's own shard of what Megatron and the engines split alike, but the whole of a tensor the engines hold
    whole that Megatron may split (``Mapping.whole_or_split``, split here: the multi-latent attention's down
    projections in the local spec), gathered as in full mode."""
    if mode == "per_rank" and entry.shard_dim is not None and entry.resolved.mapping.whole_or_split:
        return "full"
    return mode


def _item(entry: TensorEntry, spec: ModelSpec, topo: Topology, mode: Mode,
          quant: Quantization | None) -> tuple[_Item, list[str]]:
    """What this rank emits for ``entry`` (quantized where declared), and what keeps it from being quantized."""
    mine = entry.pp_owner == topo.pp_rank and entry.ep_owner in (None, topo.ep_rank)
    outputs: tuple[HFOut, ...] = entry.outputs
    shards: tuple[Shard | None, ...] = (None,) * len(entry.outputs)
    if entry_mode(entry, mode) == "per_rank" and entry.shard_dim is not None:
        rank = topo.group_rank(entry.group)
        outputs = entry.shard_outputs(spec, rank)
        nominal = entry.shard_outputs(spec, 0)
        dim = entry.shard_dim
        shards = tuple(Shard(dim, rank * n.shape[dim], o.shape[dim], full.shape[dim])
                       for o, n, full in zip(outputs, nominal, entry.outputs, strict=True))
    flags = () if quant is None else quant.flags(outputs)
    if not any(flags):
        return _Item(entry, outputs, shards, mine), []
    assert quant is not None
    expanded, placed, problems = quant.expand(outputs, shards)
    return _Item(entry, expanded, placed, mine, flags), problems


def _nominal(it: _Item, spec: ModelSpec, topo: Topology, quant: Quantization | None) -> _Item:
    """``it`` as TP rank 0 makes it (per-rank buckets are planned by rank 0's sizes, the same on every rank)."""
    return _item(it.entry, spec, replace(topo, tp_rank=0, etp_rank=0), "per_rank", quant)[0]


def _check_blocks(table: Sequence[TensorEntry], spec: ModelSpec, topo: Topology, mode: Mode,
                  quant: Quantization) -> None:
    """Every rank's shards quantized in the whole tensors' blocks, checked on every rank alike (one error
    listing each that is not), so that every rank refuses the same stream."""
    problems: list[str] = []
    for entry in table:
        split = entry_mode(entry, mode) == "per_rank" and entry.shard_dim is not None
        ranks = range(topo.group_size(entry.group)) if split else (0,)
        for rank in ranks:
            other = replace(topo, tp_rank=rank, etp_rank=rank) if entry.group == "etp" else replace(topo, tp_rank=rank)
            problems += [f"TP rank {rank}: {p}" if len(ranks) > 1 else p
                         for p in _item(entry, spec, other, mode, quant)[1]]
    if problems:
        raise ConversionError(f"cannot quantize to block FP8 {quant.fp8.block}",
                              {"shards off the block grid or tensors not 2-D": problems})
