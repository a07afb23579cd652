"""The source seam: where a stream's tensors come from.

A source tells the planner every tensor of the model (global name, shape, dtype, and where its shards
live) as rows of the global table, and, when a bucket is made, hands over what the converter reads for
the tensors of that bucket. Planning, packing, sinks and engines are the same for every source:

- :class:`~weightstream.sources.megatron.MegatronSource`: a live Megatron-Core model
  (TP/PP/VPP/EP/expert-TP shards, gathered over the trainer's groups);
- :class:`~weightstream.sources.dtensor.DTensorSource`: a transformers model sharded with
  FSDP2 (``fully_shard``) and/or tensor parallel DTensors, or a plain HF module;
- :class:`~weightstream.sources.megatron_checkpoint.MegatronCheckpointSource`: a Megatron-Core checkpoint
  on disk (``torch_dist`` or the legacy per-rank files), read tensor by tensor in one process.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from weightstream.common.cyclic_gc import no_cyclic_gc
from weightstream.converters.mapping import Converter
from weightstream.models.spec import ModelSpec
from weightstream.sources.topology import Topology

if TYPE_CHECKING:
    from weightstream.sources.table import TensorEntry

__all__ = ["CollectiveCounts", "Mode", "Fetched", "Source", "local_data", "ModuleGuard", "first_device"]


@dataclass
class CollectiveCounts:
    """The collectives a source issues, counted as it issues them (a stream's stats extend these)."""

    gathers: int = 0  # TP / expert-TP all-gathers issued
    broadcasts: int = 0  # EP / PP broadcasts issued


# What a stream yields: each HF tensor whole on every rank, or the shard each engine TP rank holds.
Mode = Literal["full", "per_rank"]

# What ``fetch`` hands back per tensor: the tensor the converter reads, or a function making it on
# demand (so only one is materialised at a time).
Fetched = Tensor | Callable[[], Tensor]


@runtime_checkable
class Source(Protocol):
    """Where a stream's tensors come from (see the module doc)."""

    topology: Topology  # this rank's coordinates: TP for per-rank shards, PP/EP for ``share``
    # Its ranks make their buckets without each other (no collective): a rank may make only some buckets.
    independent: bool
    # Its TP ranks can each send their own shards to an engine's TP rank of the same index (point to point),
    # at the coordinates in ``topology``.
    per_rank_senders: bool

    def modules(self) -> Sequence[nn.Module]:
        """The live modules the tensors belong to: a plan is kept per first module and checked against
        them before reuse. Empty: plans are not kept (each stream plans afresh)."""
        ...

    def table(self, converter: Converter, spec: ModelSpec, expected: dict[str, tuple[int, ...]] | None,
              ) -> list[TensorEntry]:
        """The global table (the same on every rank, in the same order; one error listing every problem).
        Collective over the source's ranks. The source keeps this rank's live tensors for the calls below
        (a plan keeps the source that made it)."""
        ...

    def live_device(self) -> torch.device | None:
        """Where this rank's live tensors are (after :meth:`table`); None where it holds none."""
        ...

    def direct(self, entry: TensorEntry, mode: Mode) -> Tensor | None:
        """The tensor the converter reads for ``entry`` when it is one of this rank's live tensors as it
        stands (its views are copied by the batched copies); None when it must be fetched."""
        ...

    def fetch(self, entries: Sequence[TensorEntry], mode: Mode, counts: CollectiveCounts,
              ) -> tuple[dict[str, Fetched], int]:
        """What the converter reads for ``entries`` (this rank's, of one bucket, that ``direct`` does not
        give), gathered with as few collectives as the source allows (every rank of the source calls it,
        bucket by bucket), and the bytes staged for it."""
        ...

    def share(self, buffer: Tensor, spans: Sequence[tuple[int, int | None, int, int]], mode: Mode,
              counts: CollectiveCounts) -> None:
        """After a bucket is packed: pass each part of it from the ranks that made it to the others
        (``spans``: (pp owner, ep owner, lo, hi) byte ranges). Nothing for a source whose every rank
        makes the whole bucket."""
        ...


def local_data(t: Tensor) -> Tensor:
    """The tensor that holds a parameter's data on this rank (a DTensor's local shard)."""
    return t._local_tensor if isinstance(t, DTensor) else t


_GUARDS: weakref.WeakSet[ModuleGuard] = weakref.WeakSet()
_hooked = False


def _on_module_set(parent: nn.Module, name: str, module: nn.Module) -> None:
    """torch's global hook on every submodule set (``parent.name = module``, ``ModuleList[i] = module``,
    ``add_module``): a guard watching ``parent`` no longer holds (a module replaced under the same name
    leaves every dict the same size, and the replaced module's parameters where they were)."""
    for guard in list(_GUARDS):
        if id(parent) in guard.module_ids:
            guard.moved = True


class ModuleGuard:
    """Tells, quickly, whether modules are still what a plan was made from: the same modules holding the
    same parameters (and the buffers named in ``buffers``), each on the same storage with the same shape
    and dtype, and no module, parameter or buffer added, removed or replaced anywhere (a submodule set
    through ``nn.Module``'s own ``__setattr__``/``add_module``; writing into ``_modules`` directly bypasses
    that).

    Two checks. :meth:`holds`, the full one: the plan is still the model's (a stream from it yields the
    parameters' current values). :meth:`addresses_hold`, a fraction of its cost (one data pointer per distinct
    storage): launching the plan's copies is memory safe. The copies read through addresses of the storages the
    plan was made from, which the guard keeps alive (the plan's source holds them too); a storage that still has
    its address holds valid memory there. A parameter replaced, or re-pointed (``p.data = x``), leaves its old
    storage alive and where it was: copies from it read valid but stale bytes, which only :meth:`holds` tells
    (a caller that launches on :meth:`addresses_hold` alone confirms with :meth:`holds` before it lets anyone use
    what the copies made). A storage resized in place (freed with ``resize_(0)`` for offload, then allocated
    again) moves: the old addresses point at freed memory, and :meth:`addresses_hold` says no."""

    def __init__(self, modules: Sequence[nn.Module], buffers: Sequence[str] = ()):
        """``buffers``: the buffers a plan reads besides the parameters, as ``module.name`` suffixes
        (``router.expert_bias``); only the buffers of modules so named are watched."""
        global _hooked
        if not _hooked:
            torch.nn.modules.module.register_module_module_registration_hook(_on_module_set)
            _hooked = True
        self.roots = [weakref.ref(m) for m in modules]
        named = [(n, m) for root in modules for n, m in root.named_modules()]
        every = [m for _, m in named]
        self.module_ids = set(map(id, every))
        self.moved = False
        _GUARDS.add(self)
        owners = {b.rpartition(".")[0].rpartition(".")[2] for b in buffers}
        watched = [m for n, m in named if n.rpartition(".")[2] in owners]
        names = {b.rpartition(".")[2] for b in buffers}
        # Tens of thousands of dicts and tensors, each a cache miss when a check comes between training steps:
        # as few as tell (every module's parameters and children; buffers only where a plan reads them).
        self.dicts = [m._parameters for m in every] + [m._modules for m in every] + [m._buffers for m in watched]
        self.lengths = list(map(len, self.dicts))
        held = [(m._parameters, n, p) for m in every for n, p in m._parameters.items() if p is not None]
        held += [(m._buffers, n, b) for m in watched for n, b in m._buffers.items() if b is not None and n in names]
        self.owners = [d for d, _, _ in held]
        self.names = [n for _, n, _ in held]
        self.tensors = [t for _, _, t in held]
        self.wrapped = any(local_data(t) is not t for t in self.tensors)  # DTensors: their local shards' storage
        self.meta = self._meta(self.tensors)
        # Every distinct storage of the held tensors' data (by its StorageImpl), kept alive here, and its address:
        # a handful under Megatron DDP's contiguous buffers, one per parameter otherwise.
        storages: dict[int, torch.UntypedStorage] = {}
        for t in self.tensors:
            s = local_data(t).untyped_storage()
            storages.setdefault(s._cdata, s)
        self.storages = list(storages.values())
        self.addresses = [s.data_ptr() for s in self.storages]

    def _meta(self, tensors: Sequence[Tensor]) -> list[tuple[int, torch.Size, torch.dtype]]:
        """Each tensor's (data pointer, shape, dtype), in one pass over them."""
        if self.wrapped:
            return [(local_data(t).data_ptr(), t.shape, t.dtype) for t in tensors]
        return [(t.data_ptr(), t.size(), t.dtype) for t in tensors]

    def _same_roots(self, modules: Sequence[nn.Module]) -> bool:
        """The same root modules, and no submodule set under any watched module since."""
        return (not self.moved and len(modules) == len(self.roots)
                and all(r() is m for r, m in zip(self.roots, modules, strict=True)))

    def live_roots(self) -> list[nn.Module] | None:
        """The root modules watched, where every one is still alive."""
        roots = []
        for r in self.roots:
            m = r()
            if m is None:
                return None
            roots.append(m)
        return roots

    def addresses_hold(self, modules: Sequence[nn.Module]) -> bool:
        """Whether launching the plan's copies is memory safe: the same root modules, no submodule set since, and
        every storage the held tensors' data was on still at the address it had (see the class doc). Not that the
        plan is still the model's: a parameter replaced or re-pointed passes (its old storage is alive and
        unmoved); :meth:`holds` tells that."""
        if not self._same_roots(modules):
            return False
        return list(map(torch.UntypedStorage.data_ptr, self.storages)) == self.addresses

    def holds(self, modules: Sequence[nn.Module]) -> bool:
        """Whether the modules are still what the plan was made from (see the class doc): every parameter (and
        watched buffer) the same tensor, in the same place, at the same data pointer (a storage resized in place
        moves every tensor on it), shape and dtype, and none added or removed."""
        if not self._same_roots(modules):
            return False
        if list(map(len, self.dicts)) != self.lengths:
            return False
        if not all(map(operator.is_, map(dict.get, self.owners, self.names), self.tensors)):
            return False
        with no_cyclic_gc():  # tens of thousands of new shapes: collections of a heap of a million objects midway
            return self._meta(self.tensors) == self.meta


def first_device(modules: Sequence[nn.Module]) -> torch.device:
    for m in modules:
        for p in m.parameters():
            return local_data(p).device
    return torch.device("cpu")
