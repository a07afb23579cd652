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

import functools
import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from weightstream.common.distributed import all_gather_flat
from weightstream.common.layout import layout
from weightstream.converters.mapping import Converter
from weightstream.converters.ops import Identity
from weightstream.models.spec import ModelSpec, dtype_name
from weightstream.sources.base import CollectiveCounts, Fetched, Mode
from weightstream.sources.table import RankMeta, TensorEntry, build_table
from weightstream.sources.topology import Topology

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs


__all__ = ["TP_DIM", "is_dtensor", "is_hf_module", "DTensorSource"]


TP_DIM = "tp"  # the mesh dimension that is tensor parallel (kept in per-rank mode)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def is_dtensor(t: Any) -> TypeIs[DTensor]:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def is_hf_module(module: nn.Module) -> bool:
    """A transformers model, or any module holding DTensor parameters (Megatron-Core models hold none)."""
    if type(module).__module__.startswith("megatron."):
        return False  # decided without walking tens of thousands of parameters
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        pass
    else:
        if isinstance(module, PreTrainedModel):
            return True
    return any(is_dtensor(p) for p in module.parameters())


def _shards(p) -> bool:
    """Whether a placement splits the tensor (``Shard``, and ``_StridedShard``, which is not a ``Shard``)."""
    return p.is_shard() or type(p).__name__ == "_StridedShard"


def _shard_dims(placements) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of every sharding placement."""
    for p in placements:
        if p.is_partial():
            raise ValueError(f"a parameter with a Partial placement ({placements}) holds no value to stream")
    return [(i, p.dim) for i, p in enumerate(placements) if _shards(p)]


class DTensorSource:
    """A transformers model (or an ``nn.Module`` with HF names) whose parameters are DTensors or plain."""

    independent = False  # the ranks of its meshes gather together
    per_rank_senders = False  # its shards follow its meshes, not an engine's TP layout

    def __init__(self, model: nn.Module, *, tp_mesh_dim: str = TP_DIM):
        self.model = model
        self.tp_mesh_dim = tp_mesh_dim
        self.named = self._weights(model)
        self.topology = self._topology()
        self.local: dict[str, Tensor] = {}  # the weights by table name (made by ``table``)

    @staticmethod
    def _weights(model: nn.Module) -> list[tuple[str, Tensor]]:
        named = [(n, p.detach()) for n, p in model.named_parameters()]  # tied weights once, under their first name
        for prefix, m in model.named_modules():
            for n, b in m._buffers.items():
                if b is not None and n not in m._non_persistent_buffers_set:
                    named.append((f"{prefix}.{n}" if prefix else n, b.detach()))
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
        from torch.distributed.tensor import Shard

        names = t.device_mesh.mesh_dim_names or ()
        if self.tp_mesh_dim not in names:
            return None
        i = names.index(self.tp_mesh_dim)
        p = t.placements[i]
        size = t.device_mesh.size(i)
        if type(p) is not Shard or size == 1 or t.shape[p.dim] % size:  # a plain Shard: no subclass
            return None
        return p.dim, size

    def table(self, converter: Converter, spec: ModelSpec, expected: dict[str, tuple[int, ...]] | None,
              ) -> list[TensorEntry]:
        local = self.local = dict(self.named)
        meta = RankMeta(0, 0, 0, 0,
                        tensors=tuple((n, tuple(t.shape), dtype_name(t.dtype), False) for n, t in self.named))
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
        return out

    def live_device(self) -> torch.device | None:
        return next((t.device for t in self.local.values()), None)

    def direct(self, entry: TensorEntry, mode: Mode) -> Tensor | None:
        t = self.local[entry.name]
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

    def fetch(self, entries: Sequence[TensorEntry], mode: Mode, stats: CollectiveCounts,
              ) -> tuple[dict[str, Fetched], int]:
        """One all-gather per (mesh, gathered dimensions) for ``entries``, each rank's block placed where
        DTensor puts it."""
        out: dict[str, Fetched] = {}
        batches: dict[tuple[int, tuple[int, ...]], list[TensorEntry]] = {}
        meshes: dict[int, DeviceMesh] = {}
        held: dict[str, DTensor] = {}
        for e in entries:
            t = self.local[e.name]
            if not is_dtensor(t):
                out[e.name] = t
                continue
            held[e.name] = t
            mesh = meshes.setdefault(id(t.device_mesh), t.device_mesh)
            names = mesh.mesh_dim_names or ()
            keep_tp = mode == "per_rank" and e.shard_dim is not None
            dims = tuple(i for i in range(mesh.ndim) if not (keep_tp and names[i] == self.tp_mesh_dim))
            batches.setdefault((id(mesh), dims), []).append(e)
        staged = 0
        for (mesh_id, dims), batch in batches.items():
            got, nbytes = _gather(meshes[mesh_id], dims, batch, held, per_rank=mode == "per_rank")
            out.update(got)
            stats.gathers += 1
            staged += nbytes
        return out, staged

    def share(self, buffer: Tensor, spans: Sequence[tuple[int, int | None, int, int]], mode: Mode,
              stats: CollectiveCounts) -> None:
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


@functools.lru_cache(maxsize=1 << 16)
def _runs_of(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
             placements: tuple) -> tuple[tuple[tuple[int, int], ...] | None, ...]:
    """Where the mesh rank at ``coord`` holds its shard: per tensor dim, None (the whole dim) or the runs
    ``(start, length)`` of global indices it holds, in local order. Follows DTensor's own placement rules
    (``Shard`` as ``torch.chunk``, uneven and empty shards included; ``_StridedShard``, whose shard may be
    several runs, e.g. transformers' tensor-parallel fused experts)."""
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    sizes = list(global_shape)
    index: dict[int, list[int]] = {}
    for m, p in enumerate(placements):
        if not _shards(p):
            continue
        if isinstance(p, _StridedShard):
            n, offsets = p._local_shard_size_and_offset(sizes[p.dim], mesh_shape[m], coord[m],
                                                        offset_mode=_StridedShardOffsetMode.ALL)
            if offsets is None or isinstance(offsets, int):  # typed for every mode; ALL gives them all, a list
                raise TypeError(f"torch gave {offsets!r} for every offset of a {p} shard")
            local = list(offsets)[:n] if n else []
        else:
            n, offset = p._local_shard_size_and_offset(sizes[p.dim], mesh_shape[m], coord[m])
            local = list(range(offset, offset + n)) if n else []
        prev = index.get(p.dim)
        index[p.dim] = local if prev is None else [prev[i] for i in local]
        sizes[p.dim] = n
    out: list[tuple[tuple[int, int], ...] | None] = []
    for d in range(len(global_shape)):
        if d not in index:
            out.append(None)
            continue
        runs: list[list[int]] = []
        for v in index[d]:
            if runs and runs[-1][0] + runs[-1][1] == v:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        out.append(tuple((a, b) for a, b in runs))
    return tuple(out)


def _block(e: TensorEntry, t: DTensor, coord: Sequence[int]):
    """(local shape, per-dim runs) of the shard the mesh rank at ``coord`` holds."""
    shape = tuple(t.shape)
    runs = _runs_of(shape, tuple(t.device_mesh.shape), tuple(coord), tuple(t.placements))
    local = tuple(n if r is None else sum(b for _, b in r) for n, r in zip(shape, runs, strict=True))
    return local, runs


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _gather(mesh: DeviceMesh, dims: tuple[int, ...], batch: Sequence[TensorEntry], local: dict[str, DTensor], *,
            per_rank: bool) -> tuple[dict[str, Fetched], int]:
    group, coords = _group_of(mesh, dims)
    me = dist.get_rank(group)
    blocks = [[_block(e, local[e.name], c) for e in batch] for c in coords]  # per group rank, per entry
    sizes = [[_numel(shape) * e.dtype.itemsize for e, (shape, _) in zip(batch, bs, strict=True)] for bs in blocks]
    offsets, totals = [], []
    for s in sizes:
        offs, total = layout([[n] for n in s], 16)
        offsets.append([o for (o,) in offs])
        totals.append(total)
    stride = max(totals)
    device = local[batch[0].name].to_local().device
    recv = torch.empty(stride * len(coords), dtype=torch.uint8, device=device)
    send = recv.narrow(0, me * stride, stride)
    for e, (shape, _), off in zip(batch, blocks[me], offsets[me], strict=True):
        data = local[e.name].to_local()
        if tuple(data.shape) != shape:
            raise ValueError(f"{e.name}: the local shard has shape {tuple(data.shape)}, DTensor places {shape} here")
        if data.numel():
            send.narrow(0, off, data.numel() * e.dtype.itemsize).copy_(data.contiguous().view(-1).view(torch.uint8))
    all_gather_flat(recv, send, group)
    out: dict[str, Fetched] = {}
    for k, e in enumerate(batch):
        parts = [(r * stride + offsets[r][k], blocks[r][k]) for r in range(len(coords))]
        out[e.name] = _Assemble(recv, parts, e, per_rank)
    return out, recv.numel()


class _Assemble:
    """The tensor made from every rank's shard, on demand (one at a time): the whole tensor, or in per-rank
    mode the part the gathered ranks hold together (this rank's TP shard, one block of the whole)."""

    __slots__ = ("recv", "parts", "entry", "per_rank")

    def __init__(self, recv: Tensor, parts, entry: TensorEntry, per_rank: bool):
        self.recv, self.parts, self.entry, self.per_rank = recv, parts, entry, per_rank

    def __call__(self) -> Tensor:
        e = self.entry
        live = [(at, shape, runs) for at, (shape, runs) in self.parts if _numel(shape)]
        target = e.local_shape if (self.per_rank and e.shard_dim is not None) else e.full_shape
        origin = [0] * len(target)
        if self.per_rank and e.shard_dim is not None and live:
            d = e.shard_dim
            origin[d] = min(r[d][0][0] if r[d] is not None else 0 for _, _, r in live)
        if sum(_numel(shape) for _, shape, _ in live) != _numel(target):
            raise ValueError(f"{e.name}: the gathered shards do not tile a tensor of shape {tuple(target)}")
        out = torch.empty(target, dtype=e.dtype, device=self.recv.device)
        for at, shape, runs in live:
            data = self.recv.narrow(0, at, _numel(shape) * e.dtype.itemsize).view(e.dtype).view(shape)
            # Each combination of one run per dim is a rectangular piece of the shard.
            pieces = [[(origin[d], 0, n)] if r is None else _with_local(r)
                      for d, (n, r) in enumerate(zip(shape, runs, strict=True))]
            for combo in itertools.product(*pieces):
                src, dst = data, out
                for d, (start, local, n) in enumerate(combo):
                    src = src.narrow(d, local, n)
                    dst = dst.narrow(d, start - origin[d], n)
                dst.copy_(src)
        return out


def _with_local(runs) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of each run."""
    out, local = [], 0
    for start, n in runs:
        out.append((start, local, n))
        local += n
    return out
