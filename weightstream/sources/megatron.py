"""The Megatron-Core source: a live model's parameters, under global names, gathered over its groups.

This is the only module that knows Megatron-Core's module tree: it unwraps DDP/Float16Module,
renames each VPP chunk's local layer indices to global ones (``layer_number - 1``) and each EP
rank's local expert indices to global ones (``ep_rank * experts_per_rank + e``), names a later stage's copy of
the embedding for its multi-token prediction layers ``mtp.embedding.*``, and picks up the buffers that are
weights (``router.expert_bias``). Every rank reports its tensors once (one ``all_gather_object``) to make the
global table; per bucket, TP and expert-TP shards are gathered with one
all-gather per group, and each pipeline stage's (and each expert owner's) part of the packed bucket is
broadcast over the PP (and EP) group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from weightstream.common.distributed import all_gather_flat
from weightstream.common.layout import layout
from weightstream.converters.mapping import Converter
from weightstream.models.spec import ModelSpec, dtype_name
from weightstream.sources.base import CollectiveCounts, Fetched, Mode
from weightstream.sources.names import WEIGHT_BUFFERS, global_name
from weightstream.sources.table import RankMeta, TensorEntry, build_table
from weightstream.sources.topology import Topology

__all__ = ["unwrap", "as_chunks", "LocalTensor", "MTP_EMBEDDING_OF", "local_tensors", "MegatronSource"]


def unwrap(module: nn.Module) -> nn.Module:
    """Strip DDP / Float16Module / FSDP-style wrappers: each holds the model as its child named ``module``."""
    while isinstance(inner := module._modules.get("module"), nn.Module):
        module = inner
    return module


def as_chunks(model_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(model_chunks, nn.Module):
        return [model_chunks]
    chunks = list(model_chunks)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise TypeError("model_chunks must be a torch.nn.Module or a non-empty list of them (VPP chunks)")
    return chunks


@dataclass(frozen=True, slots=True)
class LocalTensor:
    name: str  # global Megatron name
    tensor: Tensor
    expert: bool  # split over expert parallel ranks


def _layer_offsets(model: nn.Module) -> dict[int, int]:
    decoder = model._modules.get("decoder")
    layers = None if decoder is None else decoder._modules.get("layers")
    if not isinstance(layers, nn.ModuleList):
        return {}
    # Megatron-Core's TransformerLayer numbers itself from 1 across the pipeline stages.
    return {i: cast(int, layer.layer_number) - 1 for i, layer in enumerate(layers)}


# A pipeline stage that holds multi-token prediction layers but not the model's input holds a copy of the embedding
# for them (Megatron-Core keeps it equal to the first stage's): named ``mtp.embedding.*``, apart from the original.
MTP_EMBEDDING_OF = "embedding."


def _mtp_embedding_copy(model: nn.Module) -> bool:
    """Whether this chunk's embedding is its multi-token prediction layers' copy (a later stage's)."""
    return isinstance(model._modules.get("mtp"), nn.Module) and not cast(bool, model.pre_process)


def _experts_per_rank(model: nn.Module, num_experts: int, ep_size: int) -> int:
    if num_experts and num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split over {ep_size} expert-parallel ranks")
    return num_experts // ep_size if num_experts else 0


def local_tensors(
    model_chunks: nn.Module | Sequence[nn.Module], topo: Topology, num_experts: int = 0
) -> list[LocalTensor]:
    """Every parameter (and weight buffer) this rank holds, in module order, under global names."""
    out: list[LocalTensor] = []
    seen: dict[str, int] = {}
    for chunk in as_chunks(model_chunks):
        model = unwrap(chunk)
        layer_map = _layer_offsets(model)
        per_rank = _experts_per_rank(model, num_experts, topo.ep_size)
        named: list[tuple[str, Tensor]] = list(model.named_parameters())
        named += [(n, b) for n, b in model.named_buffers() if n.endswith(WEIGHT_BUFFERS)]
        mtp_embedding = _mtp_embedding_copy(model)
        for name, tensor in named:
            gname, expert = global_name(name, layer_map, topo.ep_rank, per_rank)
            if mtp_embedding and gname.startswith(MTP_EMBEDDING_OF):
                gname = "mtp." + gname
            if gname in seen:
                raise ValueError(f"two local tensors map to the same global name {gname!r} (chunks overlap?)")
            seen[gname] = len(out)
            out.append(LocalTensor(gname, tensor.detach(), expert))
    return out


class MegatronSource:
    """A live Megatron-Core model: its chunks (VPP) on this rank, and this rank's place in the job."""

    independent = False  # the ranks gather and broadcast together
    per_rank_senders = True  # TP rank r holds its own shards

    def __init__(self, chunks: Sequence[nn.Module], topology: Topology):
        self.chunks = list(chunks)
        self.topology = topology
        self.local: dict[str, Tensor] = {}  # this rank's live tensors by table name (made by ``table``)

    def modules(self) -> list[nn.Module]:
        return [unwrap(c) for c in self.chunks]

    def table(self, converter: Converter, spec: ModelSpec, expected: dict[str, tuple[int, ...]] | None,
              ) -> list[TensorEntry]:
        topo = self.topology
        local = local_tensors(self.chunks, topo, spec.num_experts)
        meta = RankMeta(
            *topo.coords,
            tensors=tuple((t.name, tuple(t.tensor.shape), dtype_name(t.tensor.dtype), t.expert) for t in local),
        )
        table = build_table(_exchange(meta, topo), converter, spec, expected, tp_size=topo.tp_size,
                            etp_size=topo.etp_size)
        self.local = {t.name: t.tensor for t in local}
        return table

    def live_device(self) -> torch.device | None:
        return next((t.device for t in self.local.values()), None)

    def direct(self, entry: TensorEntry, mode: Mode) -> Tensor | None:
        if mode == "full" and entry.shard_dim is not None:
            return None  # gathered over its TP group first
        return self.local[entry.name]

    def fetch(self, entries: Sequence[TensorEntry], mode: Mode, stats: CollectiveCounts,
              ) -> tuple[dict[str, Fetched], int]:
        """One all-gather per group (TP, expert-TP) for the split tensors among ``entries``; the others as
        they are held."""
        local = self.local
        out: dict[str, Fetched] = {e.name: local[e.name] for e in entries}
        if mode != "full":
            return out, 0
        staged = 0
        topo = self.topology
        for group_name in ("tp", "etp"):
            split = [e for e in entries if e.shard_dim is not None and e.group == group_name]
            if not split:
                continue
            parts = split[0].parts
            sizes = [[_nbytes(local[e.name])] for e in split]
            offsets, total = layout(sizes)
            device = local[split[0].name].device
            # In-place all-gather: this rank's shards are packed straight into its slot of the output.
            recv = torch.empty(total * parts, dtype=torch.uint8, device=device)
            send = recv.narrow(0, topo.group_rank(group_name) * total, total)
            for e, (off,) in zip(split, offsets, strict=True):
                t = local[e.name]
                send.narrow(0, off, _nbytes(t)).copy_(t.contiguous().view(-1).view(torch.uint8))
            all_gather_flat(recv, send, topo.group(group_name))
            stats.gathers += 1
            staged += recv.numel()
            for e, (off,) in zip(split, offsets, strict=True):
                out[e.name] = _Concat(recv, total, off, e)
        return out, staged

    def share(self, buffer: Tensor, spans: Sequence[tuple[int, int | None, int, int]], mode: Mode,
              stats: CollectiveCounts) -> None:
        topo = self.topology
        if topo.pp_size == 1 and (mode != "full" or topo.ep_size == 1):
            return
        works = []
        if mode == "full" and topo.ep_size > 1:
            for (pp, ep), lo, hi in _runs(spans, key=lambda s: (s[0], s[1])):
                if ep is not None and pp == topo.pp_rank:
                    works.append(dist.broadcast(buffer[lo:hi], group=topo.ep_group, group_src=ep, async_op=True))
            # A stage passes on, over PP, experts it has just received over EP: they must have arrived.
            for w in works:
                w.wait()
            stats.broadcasts += len(works)
            works = []
        if topo.pp_size > 1:
            for (pp,), lo, hi in _runs(spans, key=lambda s: (s[0],)):
                works.append(dist.broadcast(buffer[lo:hi], group=topo.pp_group, group_src=pp, async_op=True))
        for w in works:
            w.wait()
        stats.broadcasts += len(works)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


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
        if e.shard_dim is None:  # fetch gathers split tensors only
            raise ValueError(f"{e.name} is not split over its group: nothing to concatenate")
        return torch.cat(shards, dim=e.shard_dim)


def _exchange(meta: RankMeta, topo: Topology) -> list[RankMeta]:
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(topo.world_group) == 1:
        return [meta]
    gathered: list[Any] = [None] * dist.get_world_size(topo.world_group)
    dist.all_gather_object(gathered, meta, group=topo.world_group)
    return gathered
