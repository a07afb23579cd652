"""``stream_hf_weights``: a Megatron-Core model's weights as lazy, bounded buckets of HF tensors.

Flow for one call (on every rank of the job):

1. source: this rank's tensors under global names;
2. metadata exchange (one ``all_gather_object``) and the global table (same on all ranks);
3. plan: buckets of at most ``bucket_bytes``;
4. per bucket, lazily: gather TP/expert-TP shards of the tensors this rank's stage owns (one
   batched all-gather per group), convert, pack into the flat buffer, then broadcast each
   stage's (and each expert owner's) region over the EP and PP groups.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from weightstream.converters.ops import OpContext, convert_into
from weightstream.converters.registry import get_converter
from weightstream.models.hf import expected_hf_shapes
from weightstream.models.spec import ModelSpec, dtype_name, load_hf_config
from weightstream.streaming.bucket import Bucket, Shard, TensorMeta, view_tensor
from weightstream.streaming.plan import ALIGN, BucketPlan, layout, plan_buckets
from weightstream.streaming.source import LocalTensor, local_tensors
from weightstream.streaming.table import HFOut, RankMeta, TensorEntry, build_table
from weightstream.streaming.topology import Topology

Mode = Literal["full", "per_rank"]
DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass
class StreamStats:
    """Counters of one stream, filled as buckets are produced."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    gathers: int = 0  # TP / expert-TP all-gathers issued
    broadcasts: int = 0  # EP / PP broadcasts issued
    peak_staging_bytes: int = 0  # largest (output buffer + gather buffers + conversion temp) at once
    setup_seconds: float = 0.0  # metadata exchange, checks and planning
    seconds: float = 0.0  # producing the buckets


@dataclass
class _Item:
    entry: TensorEntry
    outputs: tuple[HFOut, ...]  # what this rank emits for the entry
    shards: tuple[Shard | None, ...]
    mine: bool  # this rank holds (a shard of) it


@dataclass
class BucketStream(Iterator[Bucket]):
    """An iterator of :class:`Bucket`; ``len()`` is the number of buckets it will yield."""

    spec: ModelSpec
    mode: Mode
    topology: Topology
    plan: list[BucketPlan]
    items: list[_Item]
    local: dict[str, Tensor]
    device: torch.device
    align: int = ALIGN
    stats: StreamStats = field(default_factory=StreamStats)
    _gen: Iterator[Bucket] | None = None

    def __len__(self) -> int:
        return len(self.plan)

    @property
    def total_bytes(self) -> int:
        return sum(o.nbytes for it in self.items for o in it.outputs)

    @property
    def num_tensors(self) -> int:
        return sum(len(it.outputs) for it in self.items)

    def __iter__(self) -> "BucketStream":
        return self

    def __next__(self) -> Bucket:
        if self._gen is None:
            self._gen = self._produce()
        return next(self._gen)

    # -- production -------------------------------------------------------------------------

    def _produce(self) -> Iterator[Bucket]:
        for bp in self.plan:
            start = time.perf_counter()
            bucket = self._build(bp)
            self.stats.seconds += time.perf_counter() - start
            self.stats.buckets += 1
            self.stats.tensors += len(bucket.metas)
            self.stats.bytes += sum(m.nbytes for m in bucket.metas)
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
            [TensorMeta(o.name, o.dtype, o.shape, off, sh) for o, off, sh in zip(it.outputs, offs, it.shards)]
            for it, offs in zip(items, offsets)
        ]
        return items, metas, total

    def metas_for_rank(self, index: int, tp_rank: int) -> list[TensorMeta]:
        """The metadata of bucket ``index`` as TP rank ``tp_rank`` makes it (per_rank mode: the shards
        differ by rank), computed locally, without communication."""
        topo = replace(self.topology, tp_rank=tp_rank, etp_rank=tp_rank if self.topology.etp_size > 1 else 0)
        items = [_item(self.items[i].entry, self.spec, topo, self.mode) for i in self.plan[index].items]
        _, metas, _ = self._layout(items)
        return [m for ms in metas for m in ms]

    def _build(self, bp: BucketPlan) -> Bucket:
        items, metas, total = self._layout([self.items[i] for i in bp.items])
        buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        gathered, gather_bytes = self._gather([it for it in items if it.mine])
        largest = 0
        for it, item_metas in zip(items, metas):
            if not it.mine:
                continue
            source = gathered.pop(it.entry.name, None)
            if source is None:
                source = self.local[it.entry.name]
            full = source() if callable(source) else source
            ctx = (
                OpContext(self.spec, parts=it.entry.parts)
                if self.mode == "full"
                else OpContext(self.spec, parts=1, shard_rank=self._group_rank(it.entry))
            )
            largest = max(largest, full.numel() * full.element_size())
            targets = [view_tensor(buffer, meta) for meta in item_metas]
            convert_into(it.entry.resolved.mapping.op, full, ctx, targets)
            del full, targets
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, total + gather_bytes + largest)
        self._broadcast(buffer, items, metas)
        return Bucket(bp.index, buffer, tuple(m for ms in metas for m in ms))

    def _group_rank(self, entry: TensorEntry) -> int:
        return self.topology.group_rank(entry.group)

    def _gather(self, mine: Sequence[_Item]) -> tuple[dict[str, Any], int]:
        """One all-gather per group (TP, expert-TP) for the split tensors among ``mine``.

        Returns name -> callable giving the whole (concatenated) tensor, and the bytes staged."""
        if self.mode != "full":
            return {}, 0
        out: dict[str, Any] = {}
        staged = 0
        for group_name in ("tp", "etp"):
            split = [it.entry for it in mine if it.entry.shard_dim is not None and it.entry.group == group_name]
            if not split:
                continue
            parts = split[0].parts
            sizes = [[self._nbytes(self.local[e.name])] for e in split]
            offsets, total = layout(sizes)
            # In-place all-gather: this rank's shards are packed straight into its slot of the output.
            recv = torch.empty(total * parts, dtype=torch.uint8, device=self.device)
            send = recv.narrow(0, self.topology.group_rank(group_name) * total, total)
            for e, (off,) in zip(split, offsets):
                t = self.local[e.name]
                send.narrow(0, off, self._nbytes(t)).copy_(t.contiguous().view(-1).view(torch.uint8))
            dist.all_gather_into_tensor(recv, send, group=self.topology.group(group_name))
            self.stats.gathers += 1
            staged += recv.numel()
            for e, (off,) in zip(split, offsets):
                out[e.name] = _Concat(recv, total, off, e)
        return out, staged

    @staticmethod
    def _nbytes(t: Tensor) -> int:
        return t.numel() * t.element_size()

    def _broadcast(self, buffer: Tensor, items: Sequence[_Item], metas: Sequence[Sequence[TensorMeta]]) -> None:
        topo = self.topology
        spans = [
            (it.entry.pp_owner, it.entry.ep_owner, ms[0].offset, ms[-1].offset + ms[-1].nbytes)
            for it, ms in zip(items, metas)
            if ms
        ]
        works = []
        if self.mode == "full" and topo.ep_size > 1:
            for (pp, ep), lo, hi in _runs(spans, key=lambda s: (s[0], s[1])):
                if ep is not None and pp == topo.pp_rank:
                    works.append(dist.broadcast(buffer[lo:hi], group=topo.ep_group, group_src=ep, async_op=True))
            # A stage passes on, over PP, experts it has just received over EP: they must have arrived.
            for w in works:
                w.wait()
            self.stats.broadcasts += len(works)
            works = []
        if topo.pp_size > 1:
            for (pp,), lo, hi in _runs(spans, key=lambda s: (s[0],)):
                works.append(dist.broadcast(buffer[lo:hi], group=topo.pp_group, group_src=pp, async_op=True))
        for w in works:
            w.wait()
        self.stats.broadcasts += len(works)


def _runs(spans, key):
    """Maximal runs of consecutive spans with equal ``key``: yields (key, lo, hi) byte ranges."""
    run_key, lo, hi = None, 0, 0
    for span in spans:
        k = key(span)
        if run_key is not None and k == run_key:
            hi = span[3]
            continue
        if run_key is not None:
            yield run_key, lo, hi
        run_key, lo, hi = k, span[2], span[3]
    if run_key is not None:
        yield run_key, lo, hi


class _Concat:
    """The whole tensor, made on demand from the all-gathered shards (so only one is materialised at a time)."""

    __slots__ = ("recv", "stride", "offset", "entry")

    def __init__(self, recv: Tensor, stride: int, offset: int, entry: TensorEntry):
        self.recv, self.stride, self.offset, self.entry = recv, stride, offset, entry

    def __call__(self) -> Tensor:
        e = self.entry
        nbytes = e.dtype.itemsize
        for d in e.local_shape:
            nbytes *= d
        shards = [
            self.recv.narrow(0, r * self.stride + self.offset, nbytes).view(e.dtype).view(e.local_shape)
            for r in range(e.parts)
        ]
        return torch.cat(shards, dim=e.shard_dim)


def _exchange(meta: RankMeta, topo: Topology) -> list[RankMeta]:
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(topo.world_group) == 1:
        return [meta]
    gathered: list[Any] = [None] * dist.get_world_size(topo.world_group)
    dist.all_gather_object(gathered, meta, group=topo.world_group)
    return gathered


def _device_of(local: Sequence[LocalTensor]) -> torch.device:
    for t in local:
        return t.tensor.device
    return torch.device("cpu")


def stream_hf_weights(
    model_chunks: nn.Module | Sequence[nn.Module],
    hf_config: Any,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    mode: Mode = "full",
    align: int = ALIGN,
    topology: Topology | None = None,
) -> BucketStream:
    """Stream a Megatron-Core model's weights as buckets of HF tensors. Call on every rank.

    ``model_chunks``: a ``GPTModel`` (possibly wrapped in DDP / Float16Module) or the list of
    VPP chunks. ``hf_config``: a transformers config, a dict with ``model_type``, or a directory.

    ``mode="full"``: each HF tensor whole, on every rank (TP shards all-gathered once per bucket,
    PP stages and EP owners broadcast). ``mode="per_rank"``: no TP gather; TP rank r yields the HF
    shards an engine's TP rank r holds, each with its :class:`Shard` placement.

    Mixture of experts: routed experts always carry their global index (``mlp.experts.{E}``, with
    ``E = ep_rank * experts_per_rank + e``). In full mode every rank yields every expert, gathered
    over expert-TP and broadcast from its EP owner within the bucket. In per_rank mode there is no
    EP traffic: each rank yields only the experts its own EP rank holds (cut by its expert-TP rank,
    the :class:`Shard` giving the placement), plus the non-expert tensors (cut by its dense TP rank).
    This serves an engine whose expert parallelism equals the trainer's: engine EP rank r loads
    the experts that trainer EP rank r yields, under the same global ids, and takes the non-expert
    tensors from any one EP rank (they are the same on all); an engine with another expert layout
    needs full mode.

    ``align``: each tensor's start in the bucket buffer is a multiple of it (default 256); ``align=1``
    packs tensors back to back, largest element size first (the layout SGLang's distributed
    receiver computes from names, dtypes and shapes alone).

    The table, checks and plan are made here, eagerly (so a bad model raises now, on every rank
    alike); the buckets are made one at a time as the returned iterator is advanced.
    """
    if mode not in ("full", "per_rank"):
        raise ValueError(f"mode must be 'full' or 'per_rank', got {mode!r}")
    start = time.perf_counter()
    topo = topology or Topology.current()
    cfg = load_hf_config(hf_config)
    spec = ModelSpec.from_hf_config(cfg)
    converter = get_converter(spec.model_type)
    local = local_tensors(model_chunks, topo, spec.num_experts)
    meta = RankMeta(
        *topo.coords,
        tensors=tuple((t.name, tuple(t.tensor.shape), dtype_name(t.tensor.dtype), t.expert) for t in local),
    )
    table = build_table(
        _exchange(meta, topo), converter, spec, expected_hf_shapes(cfg), tp_size=topo.tp_size, etp_size=topo.etp_size
    )
    items = [_item(e, spec, topo, mode) for e in table if mode == "full" or e.ep_owner in (None, topo.ep_rank)]
    planning = [
        [o.nbytes for o in (it.outputs if mode == "full" else it.entry.shard_outputs(spec, 0))] for it in items
    ]
    plan = plan_buckets(planning, bucket_bytes, align)
    stream = BucketStream(
        spec=spec,
        mode=mode,
        topology=topo,
        plan=plan,
        items=items,
        local={t.name: t.tensor for t in local},
        device=_device_of(local),
        align=align,
    )
    stream.stats.setup_seconds = time.perf_counter() - start
    return stream


def _item(entry: TensorEntry, spec: ModelSpec, topo: Topology, mode: Mode) -> _Item:
    mine = entry.pp_owner == topo.pp_rank and entry.ep_owner in (None, topo.ep_rank)
    if mode == "full" or entry.shard_dim is None:
        return _Item(entry, entry.outputs, (None,) * len(entry.outputs), mine)
    rank = topo.group_rank(entry.group)
    outputs = entry.shard_outputs(spec, rank)
    nominal = entry.shard_outputs(spec, 0)
    dim = entry.shard_dim
    shards = tuple(
        Shard(dim, rank * n.shape[dim], o.shape[dim], full.shape[dim])
        for o, n, full in zip(outputs, nominal, entry.outputs)
    )
    return _Item(entry, outputs, shards, mine)
