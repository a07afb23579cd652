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
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from weightstream.converters.mapping import Converter
from weightstream.errors import WeightstreamError
from weightstream.models.spec import ModelSpec, dtype_name
from weightstream.streaming.sources.base import Fetched
from weightstream.streaming.sources.megatron import global_name
from weightstream.streaming.table import RankMeta, TensorEntry, build_table
from weightstream.streaming.topology import Topology

if TYPE_CHECKING:
    from weightstream.streaming.stream import StreamStats

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_ITER = re.compile(r"^iter_(\d{7})$")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
# The GPT model's own tensors; anything else in a distributed checkpoint (optimizer state, RNG, ...) is not a weight.
_MODEL_ROOTS = ("embedding.", "decoder.", "output_layer.")


class CheckpointFormatError(WeightstreamError):
    """A path that is not a Megatron-Core checkpoint this reader knows, or one that is incomplete."""


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
            text = tracker.read_text().strip()
            iteration = text if text == "release" else int(text)
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


class MegatronCheckpointSource:
    """A Megatron-Core checkpoint on disk as a stream's source (``stream_hf_weights``, ``save_hf_checkpoint``;
    see :func:`weightstream.convert_checkpoint`). ``dtype``: cast floating tensors to it as they are read."""

    independent = True  # each process reads what it needs itself: no collective between ranks

    def __init__(self, path: str | os.PathLike, *, iteration: int | str | None = None,
                 dtype: torch.dtype | None = None):
        self.directory = resolve_iteration(path, iteration)
        self.dtype = dtype
        self.topology = Topology()
        if (self.directory / "metadata.json").exists():
            self.format = "torch_dist"
            self._reader: Any = _DistReader(self.directory)
        else:
            self.format = "legacy"
            self._reader = _LegacyReader(self.directory)
        self.iteration = self._reader.iteration
        self._pieces: dict[str, dict[int, _Piece]] = {}

    def modules(self) -> list:
        return []

    def _cast(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def table(self, converter: Converter, spec: ModelSpec, expected: dict[str, tuple[int, ...]],
              ) -> tuple[list[TensorEntry], dict[str, Tensor]]:
        metas, self._pieces, tp, etp = self._reader.describe(spec)
        metas = [RankMeta(m.pp, m.tp, m.ep, m.etp, tuple((n, s, dtype_name(self._cast(_dtype(d))), x)
                                                         for n, s, d, x in m.tensors)) for m in metas]
        table = build_table(metas, converter, spec, expected, tp_size=tp, etp_size=etp)
        # This one process reads every stage's and every expert owner's tensors itself.
        return [replace(e, pp_owner=0, ep_owner=None) for e in table], {}

    def direct(self, entry: TensorEntry, mode: str, local: dict[str, Tensor]) -> Tensor | None:
        return None

    def fetch(self, entries: Sequence[TensorEntry], mode: str, local: dict[str, Tensor],
              stats: "StreamStats") -> tuple[dict[str, Fetched], int]:
        if mode != "full":
            raise ValueError("a checkpoint on disk streams whole tensors (mode='full')")
        out: dict[str, Fetched] = {}
        # One piece per TP shard of a split tensor; a replicated one from its first holder.
        pieces = {e.name: dict(sorted(self._pieces[e.name].items())[: e.parts]) for e in entries}
        read = self._reader.read([p for ps in pieces.values() for p in ps.values()])
        staged = 0
        for e in entries:
            shards = [read[p] for _, p in sorted(pieces[e.name].items())]
            whole = shards[0] if len(shards) == 1 else torch.cat(shards, dim=e.shard_dim)
            whole = whole.to(e.dtype)
            staged += whole.numel() * whole.element_size()
            out[e.name] = whole
        return out, staged

    def share(self, buffer: Tensor, spans, mode: str, stats: "StreamStats") -> None:
        return None

    def close(self) -> None:
        self._reader.close()


def _dtype(d: torch.dtype | str) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    from weightstream.models.spec import dtype_from_name

    return dtype_from_name(d)


class _DistReader:
    """``torch_dist``: reads boxes of global tensors through torch.distributed.checkpoint, in one process."""

    def __init__(self, directory: Path):
        self.directory = directory
        try:
            info = json.loads((directory / "metadata.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointFormatError(f"{directory / 'metadata.json'} cannot be read: {exc}") from None
        backend, version = info.get("sharded_backend"), info.get("sharded_backend_version")
        if backend != "torch_dist" or version != 1:
            raise CheckpointFormatError(
                f"unknown distributed checkpoint format in {directory}: sharded_backend {backend!r} version "
                f"{version!r} (this reader knows torch_dist version 1)")
        from torch.distributed.checkpoint import FileSystemReader

        self.storage = FileSystemReader(str(directory))
        try:
            self.metadata = self.storage.read_metadata()
        except Exception as exc:  # noqa: BLE001
            raise CheckpointFormatError(f"{directory / '.metadata'} cannot be read: {exc}") from None
        files = sorted({info.relative_path for info in (self.metadata.storage_data or {}).values()})
        missing = [f for f in files if not (directory / f).exists()]
        if missing:
            raise CheckpointFormatError(f"the checkpoint {directory} is missing {len(missing)} shard file(s): "
                                        + ", ".join(missing))
        self.iteration = self._iteration()

    def _iteration(self) -> int | None:
        m = _ITER.match(self.directory.name)
        return int(m.group(1)) if m else None

    def describe(self, spec: ModelSpec):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        tensors, pieces = [], {}
        for key, md in self.metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata) or not key.startswith(_MODEL_ROOTS):
                continue
            size = tuple(md.size)
            stacked_layers = key.startswith("decoder.layers.") and not _LAYER.match(key)
            expert_axis = ".mlp.experts.experts." in key
            lead = int(stacked_layers) + int(expert_axis)
            if len(size) < lead:
                continue
            layer_ids = range(size[0]) if stacked_layers else [None]
            expert_ids = range(size[int(stacked_layers)]) if expert_axis else [None]
            for layer in layer_ids:
                for expert in expert_ids:
                    name = key
                    if layer is not None:
                        name = f"decoder.layers.{layer}." + key[len("decoder.layers."):]
                    if expert is not None:
                        name = name.replace(".mlp.experts.experts.", f".mlp.experts.local_experts.{expert}.")
                    offsets = tuple(i for i in (layer, expert) if i is not None) + (0,) * (len(size) - lead)
                    shape = size[lead:]
                    tensors.append((name, shape, md.properties.dtype, expert is not None))
                    pieces[name] = {0: _Piece(key, offsets, (1,) * lead + shape, lead)}
        if not tensors:
            raise CheckpointFormatError(f"{self.directory} holds no GPT model tensors (embedding.*, decoder.*, "
                                        "output_layer.*)")
        return [RankMeta(0, 0, 0, 0, tuple(tensors))], pieces, 1, 1

    def read(self, pieces: Sequence[_Piece]) -> dict[_Piece, Tensor]:
        import torch.distributed.checkpoint as dcp

        boxes = {}
        for i, p in enumerate(pieces):
            dtype = self.metadata.state_dict_metadata[p.key].properties.dtype
            boxes[f"box{i}"] = (p, torch.empty(p.shape, dtype=dtype))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({}, storage_reader=self.storage, planner=_BoxPlanner(boxes), no_dist=True)
        return {p: t.reshape(t.shape[p.lead:]) for p, t in boxes.values()}

    def close(self) -> None:
        pass


def _box_planner_type():
    import dataclasses

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxPlanner(DefaultLoadPlanner):
        """Reads boxes ``{name: (piece, out tensor)}`` of stored keys: only the stored chunks overlapping each."""

        def __init__(self, boxes):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.boxes = boxes

        def create_local_plan(self):
            items = []
            for name, (piece, out) in self.boxes.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=out.shape)
                md = self.metadata.state_dict_metadata[piece.key]
                for item in create_read_items_for_chunk_list(piece.key, md, [chunk]):
                    items.append(dataclasses.replace(
                        item, dest_index=MetadataIndex(name, item.dest_index.offset, item.dest_index.index)))
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.boxes[index.fqn][1]

    return BoxPlanner


def _BoxPlanner(boxes):  # noqa: N802 -- a class made on first use (torch.distributed.checkpoint is imported late)
    global _BOX_PLANNER
    if _BOX_PLANNER is None:
        _BOX_PLANNER = _box_planner_type()
    return _BOX_PLANNER(boxes)


_BOX_PLANNER = None


class _LegacyReader:
    """Megatron-LM's per-rank files, each opened memory-mapped (tensors are read when first touched)."""

    def __init__(self, directory: Path):
        self.directory = directory
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

    @staticmethod
    def _load(path: Path) -> dict:
        file = path / LEGACY_FILE if path.is_dir() else path
        if not file.exists():
            raise CheckpointFormatError(f"missing shard file {file}")
        try:
            return torch.load(file, map_location="cpu", mmap=True, weights_only=False)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointFormatError(f"{file} cannot be read as a Megatron checkpoint: {exc}") from None

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

    def describe(self, spec: ModelSpec):
        # Global layer offsets: chunk-major (VPP chunk v of every stage, then chunk v + 1), counted from the files.
        chunk_names = self._chunks(self._state((0, 0, 0)))
        counts: dict[tuple[int, int], int] = {}
        for v, chunk in enumerate(chunk_names):
            for p in range(self.pp):
                sd = self._state((0, p, 0))[chunk]
                counts[(v, p)] = len({int(m.group(1)) for k in sd if (m := _LAYER.match(k))})
        offsets, total = {}, 0
        for v in range(len(chunk_names)):
            for p in range(self.pp):
                offsets[(v, p)] = total
                total += counts[(v, p)]
        metas, pieces = [], {}
        for (t, p, e), _ in sorted(self.files.items()):
            state = self._state((t, p, e))
            tensors = []
            for v, chunk in enumerate(chunk_names):
                sd = state[chunk]
                layer_map = {i: offsets[(v, p)] + i for i in range(counts[(v, p)])}
                per_rank = len({int(m.group(1)) for k in sd if (m := _LOCAL_EXPERT.search(k))})
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
            metas.append(RankMeta(p, t, e, t if self.etp > 1 else 0, tuple(tensors)))
        self._open.clear()
        return metas, pieces, self.tp, self.etp

    def read(self, pieces: Sequence[_Piece]) -> dict[_Piece, Tensor]:
        out = {p: self._state(p.file)[p.chunk][p.key].clone() for p in pieces}
        # Unmap what was read: the pages of the files stay out of this process's memory between buckets
        # (opening a file again costs only its small pickled index).
        self._open.clear()
        return out

    def close(self) -> None:
        self._open.clear()
