"""The checkpoint source: a Megatron-Core checkpoint on disk, read tensor by tensor in one process, with
no process group and without re-creating the training job.

Two formats, whatever TP/PP/VPP/EP layout saved them:

- **distributed** (``megatron.core.dist_checkpointing``, ``torch_dist`` backend): ``metadata.json``,
  ``.metadata`` and ``__*_*.distcp`` files. Every tensor is stored under its global shape: layers stacked
  on a leading axis (``decoder.layers.self_attention.linear_qkv.weight`` of shape ``(L, ...)``), or one key
  per layer where the model is not homogeneous (``decoder.layers.3.mlp...``); routed experts stacked on an
  expert axis (``mlp.experts.experts.linear_fc1.weight`` of shape ``([L,] E, 2F, H)``); TP shards already
  placed as a TP-1 model holds them (q/k/v per query group, ``linear_fc1`` as ``[gate; up]``). A tensor is
  read as one box of its key (one layer, one expert), only from the stored chunks that overlap it.
- **legacy per rank** (Megatron-LM ``ckpt_format=torch``): ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/
  model_optim_rng.pt`` holding ``model`` (``model0``, ``model1``, ... with VPP), ``args``, ``iteration`` and
  ``checkpoint_version``. Each file is opened memory-mapped; layer and expert indices are local to each
  stage, chunk and EP rank and are made global here (layers in chunk-major order); TP shards are
  concatenated as the live Megatron source gathers them.

The root may be the save directory (``latest_checkpointed_iteration.txt``, ``iter_0000100/``, ``release/``)
or one iteration's directory.

Both formats are pickles, and a pickle can run any code. Unless the caller trusts the checkpoint
(``trust_checkpoint=True``), a file is read only if every global its pickle names is on an allow-list of what
Megatron saves there (:data:`LEGACY_GLOBALS`, :data:`DCP_METADATA_GLOBALS`); anything else is refused with an
error naming the globals and the file. Tensor data is checked against the CRC-32 that torch's zip format keeps
for it (each legacy rank file, each tensor item of a ``.distcp`` file), so flipped bytes fail instead of
converting; the pickled indexes (``.metadata``, legacy ``data.pkl``) are checked as far as their format allows.
Every pickle (``.metadata``, a legacy ``data.pkl``, each tensor's in a ``.distcp`` file), trusted or not, is
measured before it is unpickled and refused where it would build out of proportion to its length
(:mod:`weightstream.common.pickle_guard`).
"""

from __future__ import annotations

import functools
import importlib
import io
import json
import mmap
import os
import pickle
import re
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from weightstream.common.pickle_guard import PickleBoundError, check_pickle
from weightstream.converters.mapping import Converter
from weightstream.errors import WeightstreamError
from weightstream.models.spec import ModelSpec, dtype_name
from weightstream.sources.base import CollectiveCounts, Fetched, Mode
from weightstream.sources.names import (
    expert_count,
    global_name,
    layer_count,
    stacked_experts,
    stacked_layers,
    unstacked_name,
)
from weightstream.sources.table import RankMeta, TensorEntry, build_table
from weightstream.sources.topology import Topology

__all__ = [
    "TRACKER", "LEGACY_FILE", "CheckpointFormatError", "LEGACY_GLOBALS", "DCP_METADATA_GLOBALS", "read_dcp_metadata",
    "resolve_iteration", "MegatronCheckpointSource"
]


TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_ITER = re.compile(r"^iter_(\d{7})$")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
# The GPT model's own tensors; anything else in a distributed checkpoint (optimizer state, RNG, ...) is not a weight.
_MODEL_ROOTS = ("embedding.", "decoder.", "output_layer.")


class CheckpointFormatError(WeightstreamError):
    """A path that is not a Megatron-Core checkpoint this reader knows, or one that is incomplete, damaged or
    refused (it names globals that Megatron does not save there)."""


# What a legacy rank file (model_optim_rng.pt) may name beyond what torch's weights-only loader allows for
# tensors (typed storages, _rebuild_tensor_v2, OrderedDict, torch dtypes): Megatron-Core's own list
# (megatron/core/safe_globals.py), with which Megatron-LM reads these files back, under the names their pickles
# use. Seen in saves: argparse.Namespace (``args``, in every file, the only one in tests/helpers/megatron_saves.py's);
# numpy's _reconstruct, ndarray and dtype (``rng_state``: np.random.get_state()); AttnBackend, ModelType,
# signal.Signals and torch dtypes in Megatron-LM's ``args``; io.BytesIO (Transformer Engine's older _extra_state).
LEGACY_GLOBALS: tuple[str, ...] = (
    "argparse.Namespace",
    "types.SimpleNamespace",
    "pathlib.PosixPath",
    "pathlib._local.PosixPath",  # the same class, as Python 3.13 pickles it
    "_io.BytesIO",
    "signal.Signals",
    "numpy.core.multiarray._reconstruct",  # numpy 1 writes this name, numpy 2 the next
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)

# Every global that the ``.metadata`` of a torch_dist save names, measured by unpickling Megatron-Core 0.16
# saves (dense and MoE, torch 2.13): the checkpoint metadata classes, the save plans Megatron-Core keeps in it
# (``all_local_plans``), torch.Size, torch.strided (through _get_layout); and the torch dtype of each stored
# tensor (every torch dtype is allowed).
DCP_METADATA_GLOBALS: tuple[str, ...] = (
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.planner.SavePlan",
    "torch.distributed.checkpoint.planner.WriteItem",
    "torch.distributed.checkpoint.planner.WriteItemType",
    "torch.distributed.checkpoint.planner.TensorWriteData",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.serialization._get_layout",
    "torch.Size",
)

_TRUST_HINT = ("read only checkpoints you trust: trust_checkpoint=True (weightstream convert --trust-checkpoint) "
               "reads it anyway and lets it run any code")


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (its first non-empty line), or its type's name."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _resolve_global(name: str) -> Any:
    """The object a pickle's global ``module.qualname`` names (the longest importable module prefix)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy.core is a deprecated alias in numpy 2
                obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise CheckpointFormatError(f"{name} cannot be imported here")


@functools.cache
def _dcp_metadata_globals() -> dict[str, Any]:
    allowed = {name: _resolve_global(name) for name in DCP_METADATA_GLOBALS}
    allowed.update({f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


class _Refused:
    """What a refused global becomes while a ``.metadata`` pickle is read to its end (so that every refused
    global is named): it does nothing, whatever is done with it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a torch_dist ``.metadata`` with :data:`DCP_METADATA_GLOBALS` only; records every other global."""

    def __init__(self, file: IO[bytes]):
        super().__init__(file)
        self.refused: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        obj = _dcp_metadata_globals().get(full)
        if obj is None:
            self.refused.append(full)
            return _Refused
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id, which .metadata never holds")


def read_dcp_metadata(path: Path, *, trust: bool = False) -> Any:
    """The ``torch.distributed.checkpoint`` Metadata pickled in ``path``; refused (one error naming every
    global off the allow-list) unless ``trust``, and (trusted or not) where the pickle would build out of
    proportion to its length (:func:`~weightstream.common.pickle_guard.check_pickle`)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        data = path.read_bytes()
        check_pickle(data)
        if trust:
            metadata = pickle.loads(data)
        else:
            unpickler = _MetadataUnpickler(io.BytesIO(data))
            try:
                metadata = unpickler.load()
            except Exception:
                if not unpickler.refused:
                    raise
            if unpickler.refused:
                names = ", ".join(sorted(set(unpickler.refused)))
                raise CheckpointFormatError(f"refused to read {path}: it names {names}, which a torch_dist "
                                            f"checkpoint's metadata never holds; {_TRUST_HINT}")
    except CheckpointFormatError:
        raise
    except PickleBoundError as exc:
        raise CheckpointFormatError(f"refused to read {path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- whatever a damaged pickle raises
        raise CheckpointFormatError(f"{path} cannot be read as torch_dist metadata: {_one_line(exc)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(f"{path} holds a {type(metadata).__name__}, not torch_dist metadata")
    return metadata


class _FileWindow(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file as a file of their own (one item of a ``.distcp``
    file is a zip archive of its own)."""

    def __init__(self, file: io.BufferedIOBase, start: int, length: int):
        super().__init__()
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(view[:n]) or 0
        self._pos += got
        return got


def resolve_iteration(path: str | os.PathLike, iteration: int | str | None = None) -> Path:
    """The directory of one iteration of the checkpoint at ``path`` (see the module doc)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointFormatError(f"not a Megatron checkpoint: {root} is not a directory")
    if _is_iteration_dir(root):
        if iteration is not None and root.name not in (_iter_name(iteration), str(iteration)):
            raise CheckpointFormatError(f"{root} is the checkpoint of one iteration; --iteration {iteration} does not "
                                        "apply (give the save directory instead)")
        return root
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and (_ITER.match(p.name) or p.name == "release"))
    if not found:
        raise CheckpointFormatError(
            f"not a Megatron checkpoint: {root} has no {TRACKER}, no iter_NNNNNNN/ or release/ directory, no "
            "metadata.json (distributed format) and no mp_rank_*/ directories (legacy format)")
    if iteration is None:
        tracker = root / TRACKER
        if tracker.exists():
            iteration = _tracked_iteration(tracker)
        else:  # no tracker: the latest numbered iteration
            numbered = [int(m.group(1)) for n in found if (m := _ITER.match(n))]
            iteration = max(numbered) if numbered else "release"
    name = _iter_name(iteration)
    target = root / name
    if not target.is_dir():
        known = ", ".join("release" if n == "release" else str(int(n[5:])) for n in found)
        raise CheckpointFormatError(f"iteration {iteration} is not in {root}; it holds iterations: {known}")
    if not _is_iteration_dir(target):
        raise CheckpointFormatError(f"{target} holds neither a distributed checkpoint (metadata.json) nor legacy "
                                    "per-rank files (mp_rank_*/)")
    return target


def _tracked_iteration(tracker: Path) -> int | str:
    """The iteration ``latest_checkpointed_iteration.txt`` names: a number or ``release``."""
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(f"{tracker} cannot be read: {_one_line(exc)}") from None
    if text == "release":
        return text
    if not re.fullmatch(r"[0-9]+", text):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise CheckpointFormatError(f"{tracker} reads {shown!r}, not an iteration number or 'release' (give "
                                    "--iteration, or the iteration's directory)")
    return int(text)


def _iter_name(iteration: int | str) -> str:
    if str(iteration) == "release":
        return "release"
    try:
        return f"iter_{int(iteration):07d}"
    except ValueError:
        raise CheckpointFormatError(f"iteration must be a number or 'release', got {iteration!r}") from None


def _is_iteration_dir(d: Path) -> bool:
    return (d / "metadata.json").exists() or any(_RANK_DIR.match(p.name) for p in d.iterdir() if p.is_dir())


@dataclass(frozen=True)
class _Piece:
    """Where one shard of a tensor is stored: a box of a distributed key, or a tensor of a legacy file."""

    key: str
    offsets: tuple[int, ...] = ()  # distributed: the box's offset in the key's global tensor
    shape: tuple[int, ...] = ()  # the box (distributed) or the shard's shape
    lead: int = 0  # distributed: leading axes of the box that are the layer / expert index (size 1)
    file: tuple[int, int, int] | None = None  # legacy: (tp, pp, ep) of the rank file
    chunk: str = "model"  # legacy: the file's model entry (model, model0, ...)


@dataclass(frozen=True, slots=True)
class _StoredRank:
    """What one rank's part of a checkpoint holds, as stored: its coordinates and its tensors
    ``(name, shape, stored dtype, expert)`` (a :class:`RankMeta` once the dtype to stream is known)."""

    pp: int
    tp: int
    ep: int
    etp: int
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]


# What a reader finds in a checkpoint: every rank's tensors, where each tensor's shards are stored (by group
# rank), and the TP and expert-TP sizes it was saved with.
_Description = tuple[list[_StoredRank], dict[str, dict[int, _Piece]], int, int]


class MegatronCheckpointSource:
    """A Megatron-Core checkpoint on disk as a stream's source (``stream_hf_weights``, ``save_hf_checkpoint``;
    see :func:`weightstream.convert_checkpoint`). ``dtype``: cast floating tensors to it as they are read.
    ``trust_checkpoint``: read pickles naming any global (they may run any code); by default a file naming one
    that Megatron does not save there is refused (see the module doc)."""

    independent = True  # each process reads what it needs itself: no collective between ranks
    per_rank_senders = False  # one process reads every shard: it has no TP ranks

    def __init__(self, path: str | os.PathLike, *, iteration: int | str | None = None,
                 dtype: torch.dtype | None = None, trust_checkpoint: bool = False):
        self.directory = resolve_iteration(path, iteration)
        self.dtype = dtype
        self.topology = Topology()
        if (self.directory / "metadata.json").exists():
            self.format = "torch_dist"
            self._reader: _DistReader | _LegacyReader = _DistReader(self.directory, trust_checkpoint)
        else:
            self.format = "legacy"
            self._reader = _LegacyReader(self.directory, trust_checkpoint)
        self.iteration = self._reader.iteration
        self._pieces: dict[str, dict[int, _Piece]] = {}

    def modules(self) -> list:
        return []

    def _cast(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def table(self, converter: Converter, spec: ModelSpec, expected: dict[str, tuple[int, ...]] | None,
              ) -> list[TensorEntry]:
        stored, self._pieces, tp, etp = self._reader.describe(spec)
        metas = [RankMeta(m.pp, m.tp, m.ep, m.etp, tuple((n, s, dtype_name(self._cast(_dtype(d))), x)
                                                         for n, s, d, x in m.tensors)) for m in stored]
        table = build_table(metas, converter, spec, expected, tp_size=tp, etp_size=etp)
        # This one process reads every stage's and every expert owner's tensors itself.
        return [replace(e, pp_owner=0, ep_owner=None) for e in table]

    def live_device(self) -> torch.device | None:
        return None  # nothing is live: every tensor is read from disk

    def direct(self, entry: TensorEntry, mode: Mode) -> Tensor | None:
        return None

    def fetch(self, entries: Sequence[TensorEntry], mode: Mode, stats: CollectiveCounts,
              ) -> tuple[dict[str, Fetched], int]:
        if mode != "full":
            raise ValueError("a checkpoint on disk streams whole tensors (mode='full')")
        out: dict[str, Fetched] = {}
        # One piece per TP shard of a split tensor; a replicated one from its first holder.
        pieces = {e.name: dict(sorted(self._pieces[e.name].items())[: e.parts]) for e in entries}
        read = self._reader.read([p for ps in pieces.values() for p in ps.values()])
        staged = 0
        for e in entries:
            shards = [read[p] for _, p in sorted(pieces[e.name].items())]
            # More than one shard only where the tensor is split (``parts`` > 1, so along a ``shard_dim``).
            whole = shards[0] if len(shards) == 1 or e.shard_dim is None else torch.cat(shards, dim=e.shard_dim)
            whole = whole.to(e.dtype)
            staged += whole.numel() * whole.element_size()
            out[e.name] = whole
        return out, staged

    def share(self, buffer: Tensor, spans: Sequence[tuple[int, int | None, int, int]], mode: Mode,
              stats: CollectiveCounts) -> None:
        return None

    def close(self) -> None:
        self._reader.close()


def _dtype(d: torch.dtype | str) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    from weightstream.models.spec import dtype_from_name

    return dtype_from_name(d)


def _read_metadata_json(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path} cannot be read: {_one_line(exc)}") from None
    if not isinstance(info, dict):
        raise CheckpointFormatError(f"{path} holds a JSON {type(info).__name__}, not an object")
    return info


def _check_shard_files(directory: Path, storage_data: dict[Any, Any]) -> None:
    """Every ``.distcp`` file the metadata names: present, inside the directory, as long as its items need."""
    need: dict[str, int] = {}
    for item in storage_data.values():
        need[item.relative_path] = max(need.get(item.relative_path, 0), item.offset + item.length)
    outside = sorted(f for f in need if Path(f).name != f or f in (".", ".."))
    missing = sorted(f for f in need if f not in outside and not (directory / f).is_file())
    short = [f"{f} ({(directory / f).stat().st_size} bytes, its items need {n})" for f, n in sorted(need.items())
             if f not in outside and f not in missing and (directory / f).stat().st_size < n]
    problems = []
    if missing:
        problems.append(f"is missing {len(missing)} shard file(s): " + ", ".join(missing))
    if short:
        problems.append(f"has {len(short)} truncated shard file(s): " + ", ".join(short))
    if outside:
        problems.append(f"names {len(outside)} shard file(s) outside its directory: " + ", ".join(outside))
    if problems:
        raise CheckpointFormatError(f"the checkpoint {directory} " + "; ".join(problems))


class _DistReader:
    """``torch_dist``: reads boxes of global tensors through torch.distributed.checkpoint, in one process."""

    def __init__(self, directory: Path, trust: bool = False):
        self.directory = directory
        info = _read_metadata_json(directory / "metadata.json")
        backend, version = info.get("sharded_backend"), info.get("sharded_backend_version")
        if backend != "torch_dist" or version != 1:
            raise CheckpointFormatError(
                f"unknown distributed checkpoint format in {directory}: sharded_backend {backend!r} version "
                f"{version!r} (this reader knows torch_dist version 1)")
        self.metadata = read_dcp_metadata(directory / ".metadata", trust=trust)
        self.storage_data: dict[Any, Any] = dict(self.metadata.storage_data or {})
        _check_shard_files(directory, self.storage_data)
        self.storage = _metadata_reader_type()(str(directory), self.metadata)
        self._checked: set[Any] = set()  # storage items whose CRC-32s have been checked
        self.iteration = self._iteration()

    def _iteration(self) -> int | None:
        m = _ITER.match(self.directory.name)
        return int(m.group(1)) if m else None

    def describe(self, spec: ModelSpec) -> _Description:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        tensors: list[tuple[str, tuple[int, ...], torch.dtype, bool]] = []
        pieces: dict[str, dict[int, _Piece]] = {}
        for key, md in self.metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata) or not key.startswith(_MODEL_ROOTS):
                continue
            size = tuple(md.size)
            stacked = stacked_layers(key)
            expert_axis = stacked_experts(key)
            lead = int(stacked) + int(expert_axis)
            if len(size) < lead:
                continue
            layer_ids = range(size[0]) if stacked else [None]
            expert_ids = range(size[int(stacked)]) if expert_axis else [None]
            for layer in layer_ids:
                for expert in expert_ids:
                    name = unstacked_name(key, layer, expert)
                    offsets = tuple(i for i in (layer, expert) if i is not None) + (0,) * (len(size) - lead)
                    shape = size[lead:]
                    tensors.append((name, shape, md.properties.dtype, expert is not None))
                    pieces[name] = {0: _Piece(key, offsets, (1,) * lead + shape, lead)}
        if not tensors:
            raise CheckpointFormatError(f"{self.directory} holds no GPT model tensors (embedding.*, decoder.*, "
                                        "output_layer.*)")
        return [_StoredRank(0, 0, 0, 0, tuple(tensors))], pieces, 1, 1

    def read(self, pieces: Sequence[_Piece]) -> dict[_Piece, Tensor]:
        import torch.distributed.checkpoint as dcp

        boxes = {}
        for i, p in enumerate(pieces):
            dtype = self.metadata.state_dict_metadata[p.key].properties.dtype
            boxes[f"box{i}"] = (p, torch.empty(p.shape, dtype=dtype))
        items = _read_items(self.metadata, boxes)
        self._check_items(items)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load({}, storage_reader=self.storage, planner=_box_planner_type()(boxes, items), no_dist=True)
        except Exception as exc:  # noqa: BLE001 -- whatever torch raises for a file it cannot read
            files = sorted({self.storage_data[item.storage_index].relative_path for item in items})
            raise CheckpointFormatError(f"reading {', '.join(sorted({p.key for p in pieces}))} from "
                                        f"{', '.join(files)} in {self.directory} failed: {_dcp_failure(exc)}") from None
        return {p: t.reshape(t.shape[p.lead:]) for p, t in boxes.values()}

    def _check_items(self, items: Sequence[Any]) -> None:
        """The CRC-32s of each stored tensor item (a zip archive of its own) that ``items`` read, the first time,
        and the pickle torch unpickles to read it (:func:`_item_pickle_problems`). Costs one more pass over the
        bytes read, without copying them: for a one-rank save with 62 MB of .distcp files, 33 to 49 ms of a 0.59 s
        conversion on this 2-core machine (1.3 to 1.9 GB/s, zlib's CRC-32)."""
        by_file: dict[str, set[Any]] = {}
        for item in items:
            if item.storage_index not in self._checked:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, set()).add(item.storage_index)
        damaged, refused = [], []
        for relative_path, indexes in sorted(by_file.items()):
            with (open(self.directory / relative_path, "rb") as f,
                  mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m):
                view = memoryview(m)
                try:
                    for index in sorted(indexes, key=lambda i: self.storage_data[i].offset):
                        info = self.storage_data[index]
                        where = f"{index.fqn} (bytes {info.offset}..{info.offset + info.length} of {relative_path})"
                        problems = _zip_item_damage(f, view, info.offset, info.length)
                        damaged += [f"{where}: {problem}" for problem in problems]
                        if not problems:
                            refused += [f"{where}: {problem}"
                                        for problem in _item_pickle_problems(f, info.offset, info.length)]
                finally:
                    view.release()
            self._checked |= indexes
        if damaged:
            raise CheckpointFormatError(f"the checkpoint {self.directory} holds damaged tensor data: "
                                        + "; ".join(damaged))
        if refused:
            raise CheckpointFormatError(f"refused to read the checkpoint {self.directory}: " + "; ".join(refused))

    def close(self) -> None:
        pass


def _dcp_failure(exc: BaseException) -> str:
    """What went wrong in a ``dcp.load``: the first failure a CheckpointException wraps, on one line."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        for failure, _trace in exc.failures.values():
            return f"{type(failure).__name__}: {_one_line(failure)}"
    return f"{type(exc).__name__}: {_one_line(exc)}"


def _zip_damage(zf: zipfile.ZipFile, members: Sequence[zipfile.ZipInfo]) -> list[str]:
    """Reads ``members`` of ``zf`` through, which checks each one's CRC-32: each damaged one, with why."""
    damaged = []
    for info in members:
        try:
            with zf.open(info) as f:
                while f.read(16 << 20):
                    pass
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            damaged.append(f"{info.filename}: {_one_line(exc)}")
    return damaged


def _zip_item_damage(file: io.BufferedIOBase, view: memoryview, offset: int, length: int) -> list[str]:
    """What is wrong with the zip archive (one tensor, as torch.save writes it) at ``offset`` in ``file``
    (``view``: the file's bytes, memory-mapped)."""
    try:
        with zipfile.ZipFile(_FileWindow(file, offset, length)) as zf:
            members = zf.infolist()
            damaged = _zip_damage(zf, [m for m in members if m.compress_type != zipfile.ZIP_STORED])
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        return [f"not a zip archive: {_one_line(exc)}"]
    return damaged + [p for m in members if m.compress_type == zipfile.ZIP_STORED
                      if (p := _stored_member_damage(view, offset, length, m))]


def _item_pickle_problems(file: io.BufferedIOBase, offset: int, length: int) -> list[str]:
    """What :func:`~weightstream.common.pickle_guard.check_pickle` finds in the pickle (``data.pkl``) of the
    tensor item (a zip archive, intact) at ``offset`` in ``file``, which torch unpickles to read the tensor."""
    problems = []
    with zipfile.ZipFile(_FileWindow(file, offset, length)) as zf:
        for info in zf.infolist():
            if info.filename.endswith("data.pkl"):
                try:
                    check_pickle(zf.read(info))
                except pickle.UnpicklingError as exc:
                    problems.append(f"{info.filename}: {exc}")
    return problems


def _stored_member_damage(view: memoryview, offset: int, length: int, info: zipfile.ZipInfo) -> str | None:
    """What is wrong with one stored (uncompressed) member of the zip archive at ``offset`` in ``view``: its
    local header, its extent, its CRC-32 (computed in place, without copying the data)."""
    at = offset + info.header_offset
    header = bytes(view[at:at + 30])
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        return f"{info.filename}: no local header where the directory puts it"
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = at + 30 + name_len + extra_len
    if start + info.compress_size > offset + length:
        return f"{info.filename}: runs past the end of its item"
    crc = zlib.crc32(view[start:start + info.compress_size])
    if crc != info.CRC:
        return f"{info.filename}: CRC-32 {crc:08x}, recorded {info.CRC:08x}"
    return None


def _read_items(metadata: Any, boxes: dict[str, tuple[_Piece, Tensor]]) -> list[Any]:
    """The read items of ``boxes`` ``{name: (piece, out tensor)}``: only the stored chunks overlapping each."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
    )
    from torch.distributed.checkpoint.planner_helpers import (
        create_read_items_for_chunk_list,
    )

    items = []
    for name, (piece, out) in boxes.items():
        chunk = ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=out.shape)
        md = metadata.state_dict_metadata[piece.key]
        for item in create_read_items_for_chunk_list(piece.key, md, [chunk]):
            items.append(dataclasses.replace(
                item, dest_index=MetadataIndex(name, item.dest_index.offset, item.dest_index.index)))
    return items


@functools.cache
def _box_planner_type() -> type:
    """A class made on first use (torch.distributed.checkpoint is imported late)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan

    class BoxPlanner(DefaultLoadPlanner):
        """Reads the given read items into boxes ``{name: (piece, out tensor)}``."""

        def __init__(self, boxes: dict[str, tuple[_Piece, Tensor]], items: list[Any]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.boxes, self.items = boxes, items

        def create_local_plan(self) -> LoadPlan:
            return LoadPlan(self.items)

        def lookup_tensor(self, index: Any) -> Tensor:
            return self.boxes[index.fqn][1]

    return BoxPlanner


@functools.cache
def _metadata_reader_type() -> type:
    """A class made on first use (torch.distributed.checkpoint is imported late)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class MetadataReader(FileSystemReader):
        """torch's file-system reader that answers with metadata read once, through the allow-list, instead of
        unpickling ``.metadata`` again for every load."""

        def __init__(self, path: str, metadata: Metadata):
            super().__init__(path)
            self.metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if self.metadata.storage_meta is None:
                self.metadata.storage_meta = StorageMeta()
            self.metadata.storage_meta.load_id = self.load_id
            return self.metadata

    return MetadataReader


@dataclass
class _RankFile:
    """What the first opening of a legacy rank file found out."""

    crcs: dict[int, set[int]]  # bytes -> the CRC-32s of the file's tensor data members of that size
    allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = field(default_factory=list)  # the
    # allowed globals its pickle names, as torch.serialization.safe_globals takes them


def _inspect_rank_file(file: Path, trust: bool) -> _RankFile:
    """Check a legacy rank file before torch opens it: a complete zip archive as torch.save writes, its small
    records (``data.pkl``, ...) intact, and (unless ``trust``) every global its pickle names allowed."""
    try:
        with zipfile.ZipFile(file) as zf:
            members = zf.infolist()
            records = [m for m in members if "/data/" not in m.filename]
            pickles = [m for m in records if m.filename.endswith("/data.pkl")]
            if not pickles:
                raise CheckpointFormatError(f"{file} is a zip archive without data.pkl, not a torch.save file")
            damaged = _zip_damage(zf, records)
            index = b"" if damaged else zf.read(pickles[0])
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{file} is not a complete torch.save archive (truncated, emptied or not a "
                                    f"checkpoint): {_one_line(exc)}") from None
    if damaged:
        raise CheckpointFormatError(f"{file} is damaged: " + "; ".join(damaged))
    _check_index_pickle(file, pickles[0].filename, index)
    crcs: dict[int, set[int]] = {}
    for m in members:
        if "/data/" in m.filename:
            crcs.setdefault(m.file_size, set()).add(m.CRC)
    return _RankFile(crcs, [] if trust else _legacy_globals(file))


def _check_index_pickle(file: Path, member: str, data: bytes) -> None:
    """The pickle ``member`` of ``file`` (``data``) measured before torch unpickles it (trusted or not): refused
    where it would build out of proportion to its length (:func:`~weightstream.common.pickle_guard.check_pickle`)."""
    try:
        check_pickle(data)
    except PickleBoundError as exc:
        raise CheckpointFormatError(f"refused to read {file} ({member}): {exc}") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointFormatError(f"{file} cannot be read as a Megatron checkpoint: {member}: {exc}") from None


def _legacy_globals(file: Path) -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """The globals beyond torch's own that the pickle of ``file`` names, as ``safe_globals`` takes them; one
    error naming every one that is not in :data:`LEGACY_GLOBALS`."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception as exc:  # noqa: BLE001 -- whatever a damaged pickle raises
        raise CheckpointFormatError(f"{file} cannot be read as a Megatron checkpoint: {_one_line(exc)}") from None
    refused = sorted(n for n in names if n not in LEGACY_GLOBALS)
    if refused:
        raise CheckpointFormatError(f"refused to read {file}: it names {', '.join(refused)}, which Megatron does "
                                    f"not save in a legacy checkpoint; {_TRUST_HINT}")
    try:
        return [(_resolve_global(n), n) for n in names]
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{file} cannot be read here: {exc}") from None


def _model_entry_problems(state: dict) -> list[str]:
    """What is wrong with the model entries (``model``, ``model0``, ...) of a legacy rank file's dictionary: each
    must be a dictionary keyed by parameter names (strings)."""
    problems = []
    odd = [k for k in state if not isinstance(k, str)]
    if odd:
        problems.append(f"{len(odd)} top-level key(s) that are not strings: {_shown(odd)}")
    for chunk in (k for k in state if isinstance(k, str) and re.fullmatch(r"model\d*", k)):
        entry = state[chunk]
        if not isinstance(entry, dict):
            problems.append(f"{chunk!r} is a {type(entry).__name__}, not a dictionary of tensors")
            continue
        odd = [k for k in entry if not isinstance(k, str)]
        if odd:
            problems.append(f"{chunk!r} has {len(odd)} key(s) that are not parameter names (strings): {_shown(odd)}")
    return problems


def _shown(keys: list[Any], most: int = 5) -> str:
    """Up to ``most`` of ``keys``, each as ``repr`` cut to 80 characters."""
    shown = [r if len(r := repr(k)) <= 80 else r[:77] + "..." for k in keys[:most]]
    return ", ".join(shown) + (f", ... ({len(keys)} in all)" if len(keys) > most else "")


def _load_failure(exc: BaseException) -> str:
    """Why torch.load failed, on one line (for a weights-only refusal, the unpickler's own reason)."""
    found = re.search(r"WeightsUnpickler error: ([^\n]+)", str(exc))
    return found.group(1).strip() if found else f"{type(exc).__name__}: {_one_line(exc)}"


def _storage_crc(storage: torch.UntypedStorage) -> int:
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return zlib.crc32(raw.numpy().data)


class _LegacyReader:
    """Megatron-LM's per-rank files, each opened memory-mapped (tensors are read when first touched).

    Integrity: each file's zip records other than tensor data are checked (CRC-32) when it is first opened,
    and the storage of every tensor read is checked against the CRC-32s the file records for data of its size
    (any of them: torch's storage keys are not exposed, so a flip is missed only if the damaged bytes have the
    CRC-32 of another member of the same size, about 1 in 4e9 per member). The check costs one more pass over
    each storage read, once per bucket that reads from it: for a one-rank save with a 62 MB rank file, 28 ms
    alone (2.1 GB/s) and 29 to 80 ms of a 0.47 to 0.51 s conversion on this 2-core machine."""

    def __init__(self, directory: Path, trust: bool = False):
        self.directory = directory
        self.trust = trust
        self._inspected: dict[Path, _RankFile] = {}
        found: dict[tuple, Path] = {}
        for d in sorted(directory.iterdir()):
            m = _RANK_DIR.match(d.name)
            if m and d.is_dir():
                found[(int(m.group(1)), m.group(2), m.group(3))] = d
        first = found[min(found)]
        head = self._load(first)
        version = head.get("checkpoint_version", 0)
        if not isinstance(version, (int, float)) or version < 3.0:
            raise CheckpointFormatError(f"unknown legacy checkpoint_version {version!r} in {first / LEGACY_FILE} "
                                        "(this reader knows 3.0: query/key/value grouped per query group)")
        args = head.get("args")
        self.iteration = head.get("iteration")
        pp = int(getattr(args, "pipeline_model_parallel_size", 0) or 0)
        ep = int(getattr(args, "expert_model_parallel_size", 0) or 0)
        tp = int(getattr(args, "tensor_model_parallel_size", 0) or 0)
        suffixes = {len([s for s in k[1:] if s is not None]) for k in found}
        if len(suffixes) != 1:
            raise CheckpointFormatError(f"{directory} mixes rank directory names of different layouts")
        (n,) = suffixes
        if n == 1 and not pp and not ep:
            pp = max(int(k[1]) for k in found) + 1  # one suffix and no args: Megatron-LM writes _PPP for PP > 1
        self.files: dict[tuple[int, int, int], Path] = {}
        for (t, a, b), d in found.items():
            if n == 2:
                key = (t, int(a), int(b))
            elif n == 1:
                key = (t, int(a), 0) if (pp or 1) > 1 else (t, 0, int(a))
            else:
                key = (t, 0, 0)
            self.files[key] = d / LEGACY_FILE
        tp = tp or max(k[0] for k in self.files) + 1
        pp = pp or max(k[1] for k in self.files) + 1
        ep = ep or max(k[2] for k in self.files) + 1
        self.tp, self.pp, self.ep = tp, pp, ep
        etp = int(getattr(args, "expert_tensor_parallel_size", 0) or 0) or tp
        if etp not in (1, tp):
            raise CheckpointFormatError(f"expert tensor parallel size {etp} with TP {tp} is not supported in the "
                                        "legacy format (only expert-TP 1 or equal to TP)")
        self.etp = etp
        missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                   for t in range(tp) for p in range(pp) for e in range(ep) if (t, p, e) not in self.files]
        missing += [str(f) for f in self.files.values() if not f.exists()]
        if missing:
            raise CheckpointFormatError(f"the legacy checkpoint {directory} (TP {tp}, PP {pp}, EP {ep}) is missing "
                                        f"{len(missing)} rank file(s): " + ", ".join(missing))
        self._open: dict[tuple[int, int, int], dict] = {}

    def _load(self, path: Path) -> dict:
        file = path / LEGACY_FILE if path.is_dir() else path
        if not file.exists():
            raise CheckpointFormatError(f"missing shard file {file}")
        inspected = self._inspected.get(file)
        if inspected is None:
            inspected = self._inspected[file] = _inspect_rank_file(file, self.trust)
        try:
            with torch.serialization.safe_globals(inspected.allowed):
                state = torch.load(file, map_location="cpu", mmap=True, weights_only=not self.trust)
        except pickle.UnpicklingError as exc:  # what torch's weights-only loader refuses, the scan aside
            hint = "" if self.trust else f"; {_TRUST_HINT}"
            raise CheckpointFormatError(f"{file} cannot be read as a Megatron checkpoint: {_load_failure(exc)}"
                                        f"{hint}") from None
        except Exception as exc:  # noqa: BLE001
            raise CheckpointFormatError(f"{file} cannot be read as a Megatron checkpoint: {_load_failure(exc)}"
                                        ) from None
        if not isinstance(state, dict):
            raise CheckpointFormatError(f"{file} holds a {type(state).__name__}, not the dictionary Megatron saves")
        problems = _model_entry_problems(state)
        if problems:
            raise CheckpointFormatError(f"{file} is not a Megatron rank file as this reader knows it: "
                                        + "; ".join(problems))
        return state

    def _state(self, key: tuple[int, int, int]) -> dict:
        state = self._open.get(key)
        if state is None:
            state = self._open[key] = self._load(self.files[key])
        return state

    @staticmethod
    def _chunks(state: dict) -> list[str]:
        if "model" in state:
            return ["model"]
        chunks = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
        if not chunks:
            raise CheckpointFormatError("a legacy rank file without 'model' (or 'model0', ...) entries")
        return chunks

    def describe(self, spec: ModelSpec) -> _Description:
        # Global layer offsets: chunk-major (VPP chunk v of every stage, then chunk v + 1), counted from the files.
        chunk_names = self._chunks(self._state((0, 0, 0)))
        counts: dict[tuple[int, int], int] = {}
        for v, chunk in enumerate(chunk_names):
            for p in range(self.pp):
                sd = self._state((0, p, 0))[chunk]
                counts[(v, p)] = layer_count(sd)
        offsets, total = {}, 0
        for v in range(len(chunk_names)):
            for p in range(self.pp):
                offsets[(v, p)] = total
                total += counts[(v, p)]
        metas: list[_StoredRank] = []
        pieces: dict[str, dict[int, _Piece]] = {}
        for (t, p, e), _ in sorted(self.files.items()):
            state = self._state((t, p, e))
            tensors: list[tuple[str, tuple[int, ...], torch.dtype, bool]] = []
            for v, chunk in enumerate(chunk_names):
                sd = state[chunk]
                layer_map = {i: offsets[(v, p)] + i for i in range(counts[(v, p)])}
                per_rank = expert_count(sd)
                for name, tensor in sd.items():
                    if not isinstance(tensor, Tensor) or name.endswith("_extra_state"):
                        continue
                    gname, expert = global_name(name, layer_map, e, per_rank)
                    tensors.append((gname, tuple(tensor.shape), tensor.dtype, expert))
                    group_rank = (t if self.etp > 1 else 0) if expert else t
                    if expert and self.etp == 1 and t > 0:
                        continue  # the same expert on every TP rank: read it from TP rank 0
                    pieces.setdefault(gname, {})[group_rank] = _Piece(name, shape=tuple(tensor.shape), file=(t, p, e),
                                                                            chunk=chunk)
            metas.append(_StoredRank(p, t, e, t if self.etp > 1 else 0, tuple(tensors)))
        self._open.clear()
        return metas, pieces, self.tp, self.etp

    def read(self, pieces: Sequence[_Piece]) -> dict[_Piece, Tensor]:
        out: dict[_Piece, Tensor] = {}
        storages: dict[tuple[tuple[int, int, int], int], tuple[torch.UntypedStorage, str]] = {}
        for p in pieces:
            assert p.file is not None  # a legacy piece names its rank file
            tensor = self._state(p.file)[p.chunk][p.key]
            storage = tensor.untyped_storage()
            storages.setdefault((p.file, storage.data_ptr()), (storage, p.key))
            out[p] = tensor.clone()
        damaged = [f"{key} in {self.files[file]}" for (file, _), (storage, key) in storages.items()
                   if storage.nbytes() and _storage_crc(storage) not in
                   self._inspected[self.files[file]].crcs.get(storage.nbytes(), set())]
        # Unmap what was read: the pages of the files stay out of this process's memory between buckets
        # (opening a file again costs only its small pickled index).
        self._open.clear()
        if damaged:
            raise CheckpointFormatError("damaged tensor data (not the CRC-32 its file records): " + "; ".join(damaged))
        return out

    def close(self) -> None:
        self._open.clear()
