"""The bucket stream: a model's weights as lazy, bounded buckets of HF tensors, one at a time, each packed by
its copy program (:mod:`~weightstream.streaming.programs`) into a fresh or kept buffer, or written straight
into a receiver's tensors (:meth:`BucketStream.write_into`)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from weightstream.common.cyclic_gc import no_cyclic_gc
from weightstream.common.layout import ALIGN
from weightstream.converters.ops import OpContext, convert_into
from weightstream.models.spec import ModelSpec
from weightstream.sources.base import CollectiveCounts, Mode, Source
from weightstream.sources.table import TensorEntry
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import Bucket, TensorMeta, typed_buffer, view_tensor
from weightstream.streaming.copies import available as copies_available
from weightstream.streaming.copies import warm_kernel, warm_variants
from weightstream.streaming.fp8_cast import takes_aligned
from weightstream.streaming.fp8_cast import warm_kernel as warm_cast_kernel
from weightstream.streaming.items import StreamItem, bucket_layout, entry_mode, make_item, op_context
from weightstream.streaming.kept_plans import StreamPlan, into_key
from weightstream.streaming.plan import BucketPlan
from weightstream.streaming.programs import (
    CopyProgram,
    ItemView,
    buffer_copies,
    item_views,
    make_program,
    target_check,
    target_copies,
)
from weightstream.streaming.quantize import Quantization, QuantizeBatch, convert_quantized
from weightstream.streaming.value_checks import warm as warm_checks
from weightstream.wire.fp8 import BlockFP8

__all__ = ["StreamStats", "BucketStream"]


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
class BucketStream(Iterator[Bucket]):
    """An iterator of :class:`Bucket`; ``len()`` is the number of buckets it will yield."""

    spec: ModelSpec
    mode: Mode
    topology: Topology
    source: Source
    plan: list[BucketPlan]
    items: list[StreamItem]
    device: torch.device
    align: int = ALIGN
    stats: StreamStats = field(default_factory=StreamStats)
    quantization: Quantization | None = None  # block FP8 for the tensors the family declares
    shared: StreamPlan | None = None
    reuse_buffers: bool = False
    _gen: Iterator[Bucket] | None = None
    _programs: dict[int, CopyProgram] = field(default_factory=dict)  # without a kept plan
    # Which buckets to make (None: all). Only for a source whose ranks make their buckets without each other
    # (``source.independent``): ranks that skip different buckets would leave each other's collectives waiting.
    select: Any = None
    # ``write_into``: the receiver's tensors by HF name, written straight into (no bucket buffer), and their key.
    _into: dict[str, Tensor] | None = None
    _into_key: Any = None
    _into_flag: Tensor | None = None  # ``write_into``'s flag: raised where a value written is one a receiver checks for

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
            made = [self._copies_into(self._program_for(bp.index), self._into) for bp in self.plan]
            warm_variants(c for calls in made for c in calls)  # (checked copies: one variant per dtype)
            if self._into_flag is not None:
                warm_checks(self.device)
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

    def can_check_writes(self) -> bool:
        """Whether :meth:`write_into` can be given a flag here: the checked copies' kernels run on this device."""
        return copies_available(self.device, checked=True)

    def write_into(self, targets: dict[str, Tensor], key: Any, flag: Tensor | None = None) -> None:
        """Have every tensor written straight into ``targets[name]`` (a contiguous tensor of the tensor's dtype
        and size: a receiver's own weight, mapped into this process) instead of into a bucket buffer. The
        buckets this stream then yields carry their metadata and no bytes (``Bucket.written``). ``key``
        names the targets: the copies into them are made once per plan and key, so the key must change
        whenever a target moves. ``flag`` (an int32 of the receiver's on this device, where
        :meth:`can_check_writes`): every tensor written is looked at for NaN, infinities and block-FP8 scales out
        of range as it is written (or, where a copy cannot, right after), the flag raised where one is found
        (:mod:`~weightstream.streaming.value_checks`): the receiver need not look again. One error lists every
        tensor ``targets`` lacks or cannot hold."""
        shared = self.shared
        if shared is None or not self.can_write_into():
            raise ValueError("write_into needs a full stream in which this rank makes every tensor (no pipeline or "
                             "expert parallelism to share buckets over) with a kept plan")
        if flag is not None and not self.can_check_writes():
            raise ValueError(f"write_into with a flag: the checked copies' kernels do not run on {self.device}")
        self._into_flag = flag
        kept = into_key(key, flag is not None)
        if shared.checked_into == kept:  # checked when these targets were first given
            self._into, self._into_key = targets, kept
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
        self._into, self._into_key = targets, kept
        shared.checked_into = kept

    def _program_for(self, index: int) -> CopyProgram:
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
        items = [make_item(self.items[i].entry, self.spec, topo, self.mode, self.quantization)[0]
                 for i in self.plan[index].items]
        _, metas, _ = bucket_layout(items, self.align)
        return [m for ms in metas for m in ms]

    def _program(self, bp: BucketPlan) -> CopyProgram:
        items, metas, total = bucket_layout([self.items[i] for i in bp.items], self.align)
        return make_program(items, metas, total, self._views)

    def _views(self, it: StreamItem, metas: Sequence[TensorMeta]) -> list[ItemView] | None:
        """The views of live tensors ``it`` is copied from (:func:`item_views`), None where it is converted one
        by one."""
        mode = entry_mode(it.entry, self.mode)
        return item_views(it, metas, self.source.direct(it.entry, mode), self._context(it))

    def _context(self, it: StreamItem) -> OpContext:
        return op_context(it, self.spec, self.topology, self.mode)

    def _buffer(self, bp: BucketPlan, total: int) -> Tensor:
        """The bucket's flat buffer: a new one, or (``reuse_buffers``) one of two kept with the plan, bucket
        i in buffer ``i % 2``: the consumer is done with bucket i once it asks for bucket i + 2."""
        shared = self._kept_plan
        if shared is None:  # zeroed: the bytes between tensors (alignment) the same on every update
            return typed_buffer(total, self.device).zero_()
        slot = bp.index % 2
        kept = shared.buffers[slot]
        if kept is None or kept.numel() < total or kept.device != self.device:
            largest = max(self._program_for(b.index).total for b in self.plan)
            # zeroed once (past a bucket's end too); each pack zeroes its bucket's alignment gaps (buffer_copies),
            # which hold what the last bucket packed here left
            kept = shared.buffers[slot] = typed_buffer(largest, self.device).zero_()
        return kept

    def _copies(self, program: CopyProgram, raw: Tensor) -> list[Callable[[], Any]]:
        """The batched copies into ``raw`` (:func:`buffer_copies`), kept with the program per kept buffer, so a
        reused buffer costs no view making at all."""
        key = raw.data_ptr()
        kept = self._keeps_buffers
        made = program.copies.get(key) if kept else None
        if made is not None:
            return made
        self.stats.copy_programs += 1
        calls = buffer_copies(program, raw, self._fp8, kept=kept)
        if kept:
            stale = [k for k in program.copies if isinstance(k, int)]
            if len(stale) >= 2:  # the kept buffers were re-made
                for k in stale:
                    del program.copies[k]
            program.copies[key] = calls
        return calls

    def _copies_into(self, program: CopyProgram, into: dict[str, Tensor]) -> list[Callable[[], Any]]:
        """The batched copies of ``program`` straight into the :meth:`write_into` targets ``into``
        (:func:`target_copies`), made once per plan and targets; with the :meth:`write_into` flag, also the check
        of what they do not look at as they copy, and of the tensors converted one by one
        (``program.checks``, same key)."""
        made = program.copies.get(self._into_key)
        if made is not None:
            return made
        self.stats.copy_programs += 1
        flag = self._into_flag
        calls, unchecked = target_copies(program, into, self._fp8, flag)
        if flag is not None:
            unchecked += [(m.name, into[m.name]) for k in program.slow for m in program.item_metas[k]]
            if unchecked:
                program.checks[self._into_key] = target_check(unchecked, flag)
        program.copies[self._into_key] = calls
        return calls

    @property
    def _fp8(self) -> BlockFP8 | None:
        return None if self.quantization is None else self.quantization.fp8

    def _build_into(self, bp: BucketPlan, program: CopyProgram, into: dict[str, Tensor]) -> Bucket:
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
        check = program.checks.get(self._into_key)
        if check is not None:  # what the copies did not look at as they wrote it
            check()
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

    def _count(self, program: CopyProgram, staged: int) -> None:
        self.stats.batched += program.batched
        self.stats.copies += sum(len(sources) for _, _, sources in program.runs) + len(program.strided)
        self.stats.unbatched += len(program.slow)
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, staged)

    def _build(self, bp: BucketPlan, program: CopyProgram) -> Bucket:
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

    def _convert(self, it: StreamItem, full: Tensor, targets: list[Tensor], batch: QuantizeBatch | None) -> None:
        """What the converter reads for ``it``, converted into ``targets`` (quantized where declared: queued in
        ``batch``, which the caller runs once the bucket's tensors are all in)."""
        op = it.entry.resolved.mapping.op
        if batch is not None and self.quantization is not None and any(it.quantized):
            convert_quantized(op, full, self._context(it), it.quantized, targets, batch)
        else:
            convert_into(op, full, self._context(it), targets)
