"""The DTensor source: a transformers model sharded with FSDP2 (``fully_shard``), with tensor parallel
DTensors, both (a 2-D mesh), or not at all.

Its parameters carry HF in-memory names, which the family's converter turns into checkpoint names
(:meth:`~weightstream.converters.mapping.Converter.in_memory`: transformers 5's fused MoE experts become
one tensor per expert). Every rank knows every parameter's global shape, so the table needs no metadata
exchange. Per bucket, the sharded parameters of one mesh are gathered with one all-gather (over the whole
mesh in full mode; over every mesh dimension but ``tp`` in per-rank mode, which then yields this rank's
tensor-parallel shard, as an engine with the same TP layout holds it), each rank's block placed by the
offsets DTensor itself defines (even and uneven shards, ``Shard``, ``_StridedShard`` and ``Replicate``).
Replicated and plain parameters are read in place, by the batched copies. A model that FSDP2 holds
unsharded (after a forward without resharding) streams from its plain parameters, with no gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from weightstream.converters.mapping import Converter
from weightstream.converters.ops import Identity
from weightstream.models.spec import ModelSpec, dtype_name
from weightstream.streaming.plan import layout
from weightstream.streaming.sources.base import Fetched
from weightstream.streaming.table import RankMeta, TensorEntry, build_table
from weightstream.streaming.topology import Topology

if TYPE_CHECKING:
    from weightstream.streaming.stream import StreamStats

TP_DIM = "tp"  # the mesh dimension that is tensor parallel (kept in per-rank mode)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def is_hf_module(module: nn.Module) -> bool:
    """A transformers model, or any module holding DTensor parameters (Megatron-Core models hold none)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        PreTrainedModel = ()  # noqa: N806
    if PreTrainedModel and isinstance(module, PreTrainedModel):
        return True
    return any(is_dtensor(p) for p in module.parameters())


def _shard_dims(placements) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of every sharding placement."""
    return [(i, p.dim) for i, p in enumerate(placements) if p.is_shard()]


class DTensorSource:
    """A transformers model (or an ``nn.Module`` with HF names) whose parameters are DTensors or plain."""

    def __init__(self, model: nn.Module, *, tp_mesh_dim: str = TP_DIM):
        self.model = model
        self.tp_mesh_dim = tp_mesh_dim
        self.named = self._weights(model)
        self.topology = self._topology()

    @staticmethod
    def _weights(model: nn.Module) -> list[tuple[str, Tensor]]:
        named = list(model.named_parameters())  # tied weights once, under their first name
        for prefix, m in model.named_modules():
            for n, b in m._buffers.items():
                if b is not None and n not in m._non_persistent_buffers_set:
                    named.append((f"{prefix}.{n}" if prefix else n, b))
        return named

    def _tp_mesh(self):
        for _, t in self.named:
            if is_dtensor(t):
                names = t.device_mesh.mesh_dim_names or ()
                if self.tp_mesh_dim in names:
                    return t.device_mesh
        return None

    def _topology(self) -> Topology:
        mesh = self._tp_mesh()
        if mesh is None:
            return Topology()
        return Topology(tp_size=mesh.size(mesh.mesh_dim_names.index(self.tp_mesh_dim)),
                        tp_rank=mesh.get_local_rank(self.tp_mesh_dim), tp_group=mesh.get_group(self.tp_mesh_dim))

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def _tp_placement(self, t: Tensor) -> tuple[int, int] | None:
        """(tensor dim, TP size) when ``t`` is split evenly over the ``tp`` mesh dimension by a plain Shard."""
        if not is_dtensor(t):
            return None
        names = t.device_mesh.mesh_dim_names or ()
        if self.tp_mesh_dim not in names:
            return None
        i = names.index(self.tp_mesh_dim)
        p = t.placements[i]
        size = t.device_mesh.size(i)
        if type(p).__name__ != "Shard" or size == 1 or t.shape[p.dim] % size:
            return None
        return p.dim, size

    def table(self, converter: Converter, spec: ModelSpec, expected: dict[str, tuple[int, ...]],
              ) -> tuple[list[TensorEntry], dict[str, Tensor]]:
        local = dict(self.named)
        meta = RankMeta(0, 0, 0, 0, tensors=tuple((n, tuple(t.shape), dtype_name(t.dtype), False) for n, t in self.named))
        table = build_table([meta], converter.in_memory(), spec, expected, tp_size=1)
        out = []
        for entry in table:
            tp = self._tp_placement(local[entry.name])
            if tp is not None and isinstance(entry.resolved.mapping.op, Identity):
                dim, size = tp
                shape = list(entry.local_shape)
                shape[dim] //= size
                entry = replace(entry, local_shape=tuple(shape), shard_dim=dim, parts=size)
            out.append(entry)
        return out, local

    def direct(self, entry: TensorEntry, mode: str, local: dict[str, Tensor]) -> Tensor | None:
        t = local[entry.name]
        if not is_dtensor(t):
            return t
        sharded = _shard_dims(t.placements)
        if not sharded:
            return t.to_local()
        names = t.device_mesh.mesh_dim_names or ()
        if (mode == "per_rank" and entry.shard_dim is not None
                and all(names and names[i] == self.tp_mesh_dim for i, _ in sharded)):
            return t.to_local()
        return None

    def fetch(self, entries: Sequence[TensorEntry], mode: str, local: dict[str, Tensor],
              stats: "StreamStats") -> tuple[dict[str, Fetched], int]:
        """One all-gather per (mesh, gathered dimensions) for ``entries``, each rank's block placed where
        DTensor puts it."""
        out: dict[str, Fetched] = {}
        batches: dict[tuple, list[TensorEntry]] = {}
        for e in entries:
            t = local[e.name]
            if not is_dtensor(t):
                out[e.name] = t
                continue
            mesh = t.device_mesh
            names = mesh.mesh_dim_names or ()
            keep_tp = mode == "per_rank" and e.shard_dim is not None
            dims = tuple(i for i in range(mesh.ndim) if not (keep_tp and names[i] == self.tp_mesh_dim))
            batches.setdefault((id(mesh), dims), []).append(e)
        staged = 0
        for (_, dims), batch in batches.items():
            mesh = local[batch[0].name].device_mesh
            got, nbytes = _gather(mesh, dims, batch, local, per_rank=mode == "per_rank")
            out.update(got)
            stats.gathers += 1
            staged += nbytes
        return out, staged

    def share(self, buffer: Tensor, spans, mode: str, stats: "StreamStats") -> None:
        return None  # every rank makes the whole bucket


def _group_of(mesh, dims: tuple[int, ...]):
    """The process group over mesh dimensions ``dims`` (this rank's slice), and the mesh coordinates of
    its ranks in group-rank order."""
    if len(dims) == 1:
        group = mesh.get_group(dims[0])
    elif len(dims) == mesh.ndim and mesh.size() == dist.get_world_size():
        group = dist.group.WORLD
    else:
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError("a DTensor mesh of several unnamed dimensions cannot be gathered over a part of them")
        group = mesh[tuple(names[i] for i in dims)]._flatten().get_group()
    ranks = dist.get_process_group_ranks(group)
    grid = mesh.mesh
    coords = []
    for r in ranks:
        where = (grid == r).nonzero()
        if where.shape[0] != 1:
            raise ValueError(f"rank {r} of the gather group is not in the DTensor mesh {grid.tolist()}")
        coords.append([int(c) for c in where[0]])
    return group, coords


def _block(e: TensorEntry, t: Tensor, coord: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, offset = _compute_local_shape_and_global_offset(tuple(t.shape), tuple(t.device_mesh.shape), list(coord),
                                                           t.placements)
    return tuple(shape), tuple(offset)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _gather(mesh, dims: tuple[int, ...], batch: Sequence[TensorEntry], local: dict[str, Tensor], *, per_rank: bool,
            ) -> tuple[dict[str, Fetched], int]:
    group, coords = _group_of(mesh, dims)
    me = dist.get_rank(group)
    blocks = [[_block(e, local[e.name], c) for e in batch] for c in coords]  # per group rank, per entry
    sizes = [[_numel(shape) * e.dtype.itemsize for e, (shape, _) in zip(batch, bs)] for bs in blocks]
    offsets, totals = [], []
    for s in sizes:
        offs, total = layout([[n] for n in s], 16)
        offsets.append([o for (o,) in offs])
        totals.append(total)
    stride = max(totals)
    device = local[batch[0].name].to_local().device
    recv = torch.empty(stride * len(coords), dtype=torch.uint8, device=device)
    send = recv.narrow(0, me * stride, stride)
    for e, (shape, _), off in zip(batch, blocks[me], offsets[me]):
        data = local[e.name].to_local()
        if tuple(data.shape) != shape:
            raise ValueError(f"{e.name}: the local shard has shape {tuple(data.shape)}, DTensor places {shape} here")
        if data.numel():
            send.narrow(0, off, data.numel() * e.dtype.itemsize).copy_(data.contiguous().view(-1).view(torch.uint8))
    dist.all_gather_into_tensor(recv, send, group=group)
    out: dict[str, Fetched] = {}
    for k, e in enumerate(batch):
        parts = [(r * stride + offsets[r][k], blocks[r][k]) for r in range(len(coords))]
        out[e.name] = _Assemble(recv, parts, e, per_rank)
    return out, recv.numel()


class _Assemble:
    """The tensor made from every rank's block, on demand (one at a time): the whole tensor, or in per-rank
    mode the union of the gathered blocks (this rank's TP shard)."""

    __slots__ = ("recv", "parts", "entry", "per_rank")

    def __init__(self, recv: Tensor, parts, entry: TensorEntry, per_rank: bool):
        self.recv, self.parts, self.entry, self.per_rank = recv, parts, entry, per_rank

    def __call__(self) -> Tensor:
        e = self.entry
        live = [(at, shape, off) for at, (shape, off) in self.parts if _numel(shape)]
        target = e.local_shape if (self.per_rank and e.shard_dim is not None) else e.full_shape
        origin = [min(off[d] for _, _, off in live) for d in range(len(target))] if live else [0] * len(target)
        if sum(_numel(shape) for _, shape, _ in live) != _numel(target):
            raise ValueError(f"{e.name}: the gathered shards do not tile a tensor of shape {tuple(target)}")
        out = torch.empty(target, dtype=e.dtype, device=self.recv.device)
        for at, shape, off in live:
            view = out
            for d, (o, n) in enumerate(zip(off, shape)):
                view = view.narrow(d, o - origin[d], n)
            view.copy_(self.recv.narrow(0, at, _numel(shape) * e.dtype.itemsize).view(e.dtype).view(shape))
        return out
