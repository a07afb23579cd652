"""How a received bucket goes into the weights: its tensors' layout (dense, per rank, as the trainer's plan lays
it out), the copy program made once per layout (the runs that cut the buffer, each tensor's parameter, the batched
copies out of a kept buffer), the programs kept across updates, and the checksum a bucket is checked against."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from weightstream.models.spec import dtype_from_name, dtype_name
from weightstream.streaming.bucket import Shard, TensorMeta, typed_runs, typed_views
from weightstream.streaming.copies import batched_copy
from weightstream.wire.frames import BucketLayout, Export, ExportedWeights
from weightstream.wire.handles import checksum, dumps_b64, share_fd

__all__ = [
    "ChecksumError", "verify_checksum", "dense_layout", "wire_meta", "plan_metas", "Run", "CopyProgram",
    "copy_program", "PiecesProgram", "WeightExport", "export_weights", "ProgramCache", "KEPT_COPIES"
]

KEPT_COPIES = 4  # the batched copies a program keeps, one set per kept buffer it is loaded out of


class ChecksumError(RuntimeError):
    pass


def verify_checksum(buffer: torch.Tensor, expected: str | None, what: str,
                    detail: Callable[[], str] | None = None, error: type[Exception] = ChecksumError) -> None:
    """Raise ``error`` where ``buffer``'s bytes are not those the sender summed (``expected``; None: unchecked).
    ``what`` names the bucket; ``detail``, made only then, what the error adds (its tensors)."""
    if expected is None:
        return
    got = checksum(buffer)
    if got != expected:
        raise error(f"{what} arrived corrupted (checksum {got} != sender's {expected}); nothing of it was loaded"
                    + (detail() if detail is not None else ""))


def dense_layout(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorMeta]:
    """SGLang's flattened-bucket layout for the distributed path: back to back, in ``names`` order."""
    metas, offset = [], 0
    for name, dt, shape in zip(names, dtypes, shapes, strict=True):
        dtype = dtype_from_name(dt)
        if offset % dtype.itemsize:
            raise ValueError(f"{name}: starts at byte {offset}, not a multiple of its {dtype} size")
        meta = TensorMeta(name, dtype, tuple(int(d) for d in shape), offset)
        metas.append(meta)
        offset += meta.nbytes
    return metas


def wire_meta(m: dict) -> TensorMeta:
    """A tensor of a per-rank bucket as a P2P request names it (name, dtype, shape, offset, shard)."""
    return TensorMeta(m["name"], dtype_from_name(m["dtype"]), tuple(m["shape"]), m["offset"],
                      Shard(**m["shard"]) if m.get("shard") else None)


def plan_metas(layout: BucketLayout) -> list[TensorMeta]:
    """A bucket's tensors as the trainer's :class:`~weightstream.wire.frames.Plan` lays them out (each at its
    offset)."""
    return [TensorMeta(n, dtype_from_name(d), tuple(s), o)
            for n, d, s, o in zip(layout.names, layout.dtypes, layout.shapes, layout.offsets, strict=True)]


Run = tuple[torch.dtype, list[int], list[tuple[str, torch.Tensor]]]  # one dtype's split sizes and its tensors


@dataclass(frozen=True, slots=True)
class CopyProgram:
    """How one bucket layout loads: ``runs`` (how to cut the buffer, with each tensor's name and parameter) where
    every tensor of the bucket loads by a plain copy, else None; ``names`` in the order the runs cut, and
    ``targets`` per run (one dtype each: the batched copy of a run takes the GPU's fused kernels). ``key``: where
    it is kept in a :class:`ProgramCache` once a bucket has loaded by it (None: kept elsewhere, or not at all).
    ``copies``: the batched copies made out of each kept buffer (by its address), at most :data:`KEPT_COPIES`."""

    metas: tuple[TensorMeta, ...]
    total: int
    runs: tuple[Run, ...] | None
    key: tuple | None
    names: tuple[str, ...]
    targets: tuple[list[torch.Tensor], ...]
    copies: dict[int, list[Callable[[], Any]]] = field(default_factory=dict, compare=False)

    def copies_from(self, raw: torch.Tensor, kept: bool) -> list[Callable[[], Any]]:
        """The batched copies of the runs out of ``raw``; kept with the program for a kept buffer (``kept``)."""
        assert self.runs is not None  # only a program of plain copies is cut this way
        copies = self.copies.get(raw.data_ptr()) if kept else None
        if copies is None:
            copies = [batched_copy(targets, list(typed_views(raw, dtype, sizes)), stable=kept)
                      for (dtype, sizes, _), targets in zip(self.runs, self.targets, strict=True)]
            if kept:
                if len(self.copies) >= KEPT_COPIES:
                    self.copies.clear()
                self.copies[raw.data_ptr()] = copies
        return copies


def copy_program(metas: Sequence[TensorMeta], targets: Sequence[torch.Tensor] | None,
                 key: tuple | None = None) -> CopyProgram:
    """The program of a bucket of ``metas`` whose tensors go whole into ``targets`` (the model's
    :meth:`~weightstream.receiver.model.LoadableModel.whole_targets`; None: not every one loads by a copy)."""
    total = metas[-1].offset + metas[-1].nbytes if metas else 0
    runs = None if targets is None else tuple(typed_runs(
        (m.dtype, m.offset, m.numel, (m.name, t)) for m, t in zip(metas, targets, strict=True)))
    return CopyProgram(metas=tuple(metas), total=total, runs=runs, key=key,
                       names=tuple(n for _, _, payload in runs or () for n, _ in payload),
                       targets=tuple([t for _, t in payload] for _, _, payload in runs or ()))


@dataclass(frozen=True, slots=True)
class PiecesProgram:
    """A resharded bucket's pieces loaded by plain copies: the tensors' names, their parameters (``targets``, one
    run: kept as backups) and the view of a parameter each piece fills (``dests``, in the pieces' order)."""

    names: tuple[str, ...]
    targets: tuple[list[torch.Tensor], ...]
    dests: tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class WeightExport:
    """Where a colocated trainer may write a plan's tensors itself: the export's ``id``, ``weights`` (what
    :class:`~weightstream.wire.frames.ExportedWeights` says of our weights' storages), the plan's ``names``, the
    parameters they go into (``targets``) and each storage whole (``wholes``). On a GPU, ``flag``: one int32 of
    its own, which a trainer whose copies check what they write raises (exported after the weights' storages)."""

    id: str
    weights: ExportedWeights
    names: tuple[str, ...]
    targets: tuple[torch.Tensor, ...]
    wholes: tuple[torch.Tensor, ...]
    flag: torch.Tensor | None = None

    def frame(self) -> tuple[Export, list[int]]:
        """The export as a trainer that does not hold it gets it: on the CPU the storages' descriptors (the same each
        time); on a GPU their CUDA IPC handles, pickled for this trainer (each pickle is one receiver's reference)."""
        if self.weights.sizes is not None:  # the CPU's: storages in shared-memory files
            fds = [share_fd(w.untyped_storage())[0] for w in self.wholes]
            return Export(self.id, self.weights), fds
        shared = list(self.wholes) + ([] if self.flag is None else [self.flag.view(torch.uint8)])
        return Export(self.id, replace(self.weights, payload=dumps_b64(shared))), []


def export_weights(programs: Sequence[CopyProgram], device: torch.device) -> WeightExport:
    """The export of the weights ``programs`` copy into (every tensor of them a whole weight): each storage once,
    each tensor's place in it. On the CPU each storage moves into an unnamed shared-memory file, in place (our views
    follow it): what is sent is its descriptor, which no later trainer's exit or kill can take away."""
    names = [n for program in programs for n in program.names]
    targets = [t for program in programs for group in program.targets for t in group]
    storages: dict[int, int] = {}
    wholes: list[torch.Tensor] = []
    where: list[int] = []
    for t in targets:
        st = t.untyped_storage()
        idx = storages.get(st._cdata)
        if idx is None:
            idx = storages[st._cdata] = len(wholes)
            wholes.append(torch.empty(0, dtype=torch.uint8, device=device).set_(st))
        where.append(idx)
    cpu = device.type == "cpu"
    sizes = tuple(share_fd(w.untyped_storage())[1] for w in wholes) if cpu else None
    weights = ExportedWeights(
        names=tuple(names), storages=tuple(where),
        offsets=tuple(int(t.storage_offset()) * t.element_size() for t in targets),
        numels=tuple(int(t.numel()) for t in targets), dtypes=tuple(dtype_name(t.dtype) for t in targets),
        sizes=sizes, payload=None, flag=None if cpu else len(wholes))
    flag = None if cpu else torch.zeros(4, dtype=torch.int32, device=device)  # (16 bytes: [0] is the flag)
    return WeightExport(uuid.uuid4().hex, weights, tuple(names), tuple(targets), tuple(wholes), flag)


class ProgramCache:
    """Bucket programs by their bucket's layout, least recently used dropped first, within ``capacity`` tensors in all
    (a program counts its bucket's tensors, at least one): as many as four layouts of the whole model at the default
    bound, whatever the requests name. Only buckets that loaded are put here, so a refused request leaves nothing."""

    def __init__(self, capacity: int):
        self.capacity = max(capacity, 1)
        self.tensors = 0  # held, in all
        self._entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def get(self, key: tuple) -> Any:
        """The program kept under ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: tuple, program: Any, tensors: int) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.tensors -= old[1]
        weight = max(tensors, 1)
        self._entries[key] = (program, weight)
        self.tensors += weight
        while self.tensors > self.capacity and len(self._entries) > 1:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.tensors -= dropped

    def clear(self) -> None:
        self._entries.clear()
        self.tensors = 0
