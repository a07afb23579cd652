"""What each rank emits for each tensor of the table: the HF tensors whole, or (per-rank mode) the shards an
engine's TP rank holds with their :class:`Shard` placement; block FP8 values and scales where the family declares
them; and where each tensor goes in a bucket buffer (:func:`bucket_layout`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from weightstream.common.layout import layout
from weightstream.converters.ops import OpContext
from weightstream.errors import ConversionError
from weightstream.models.spec import ModelSpec
from weightstream.sources.base import Mode
from weightstream.sources.table import HFOut, TensorEntry
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import Shard, TensorMeta
from weightstream.streaming.quantize import Quantization

__all__ = ["StreamItem", "entry_mode", "make_item", "nominal_item", "check_blocks", "bucket_layout", "op_context"]


@dataclass
class StreamItem:
    entry: TensorEntry
    outputs: tuple[HFOut, ...]  # what this rank emits for the entry
    shards: tuple[Shard | None, ...]
    mine: bool  # this rank holds (a shard of) it
    quantized: tuple[bool, ...] = ()  # per HF tensor of the op, whether it leaves as block FP8 (empty: none)


# A batched HF tensor: the view of a live tensor it is made from, its metadata, and its scales' where it leaves as


def entry_mode(entry: TensorEntry, mode: Mode) -> Mode:
    """The mode ``entry`` is made in by a stream of ``mode``. Per-rank mode yields what each engine TP rank holds:
    a rank's own shard of what Megatron and the engines split alike, but the whole of a tensor the engines hold
    whole that Megatron may split (``Mapping.whole_or_split``, split here: the multi-latent attention's down
    projections in the local spec), gathered as in full mode."""
    if mode == "per_rank" and entry.shard_dim is not None and entry.resolved.mapping.whole_or_split:
        return "full"
    return mode


def make_item(entry: TensorEntry, spec: ModelSpec, topo: Topology, mode: Mode,
          quant: Quantization | None) -> tuple[StreamItem, list[str]]:
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
        return StreamItem(entry, outputs, shards, mine), []
    assert quant is not None
    expanded, placed, problems = quant.expand(outputs, shards)
    return StreamItem(entry, expanded, placed, mine, flags), problems


def nominal_item(it: StreamItem, spec: ModelSpec, topo: Topology, quant: Quantization | None) -> StreamItem:
    """``it`` as TP rank 0 makes it (per-rank buckets are planned by rank 0's sizes, the same on every rank)."""
    return make_item(it.entry, spec, replace(topo, tp_rank=0, etp_rank=0), "per_rank", quant)[0]


def check_blocks(table: Sequence[TensorEntry], spec: ModelSpec, topo: Topology, mode: Mode,
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
                         for p in make_item(entry, spec, other, mode, quant)[1]]
    if problems:
        raise ConversionError(f"cannot quantize to block FP8 {quant.fp8.block}",
                              {"shards off the block grid or tensors not 2-D": problems})


def bucket_layout(items: list[StreamItem], align: int) -> tuple[list[StreamItem], list[list[TensorMeta]], int]:
    """Where each tensor of ``items`` goes in the bucket buffer.

    With ``align`` >= 8 every tensor starts on an ``align`` boundary. With a smaller ``align``
    (``1``: SGLang's dense flattened bucket, back to back) items are ordered by element size,
    largest first, so that every tensor still starts at a multiple of its own element size.
    """
    if align < 8:
        items = sorted(items, key=lambda it: -it.entry.dtype.itemsize)
    offsets, total = layout([[o.nbytes for o in it.outputs] for it in items], align)
    metas = [
        [TensorMeta(o.name, o.dtype, o.shape, off, sh)
         for o, off, sh in zip(it.outputs, offs, it.shards, strict=True)]
        for it, offs in zip(items, offsets, strict=True)
    ]
    return items, metas, total


def op_context(it: StreamItem, spec: ModelSpec, topology: Topology, mode: Mode) -> OpContext:
    """What the converter's op of ``it`` is told: the whole tensor's parts, or this rank's shard."""
    if entry_mode(it.entry, mode) == "full":
        return OpContext(spec, parts=it.entry.parts)
    return OpContext(spec, parts=1, shard_rank=topology.group_rank(it.entry.group))
