"""``save_hf_checkpoint``: the stream written as a Hugging Face safetensors checkpoint.

Every tensor's shape is known before any data moves, so each shard file's safetensors header is
written first and the tensor bytes are appended as buckets arrive: memory stays bounded by the
stream's buckets, whatever the shard size. Where the config is given as a model directory, its other files
(tokenizer, ``generation_config.json``, chat template, ...: :func:`~weightstream.common.hf_files.non_weight_files`)
are copied beside the shards, so that the output serves as it is. Every file is written into a staging directory
beside the output directory, which is moved into place whole once every shard, the index and ``config.json`` are
complete (:mod:`weightstream.common.staging`): a reader never sees a partial checkpoint, or a mix of an old one
and a new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import nn

from weightstream.common.hf_files import INDEX_NAME, non_weight_files, shard_name
from weightstream.common.staging import OutputDirectoryError, StagedDirectory, writing
from weightstream.errors import WeightstreamError
from weightstream.models.spec import ConfigFields, dtype_name, load_hf_config
from weightstream.sinks.base import Delivery
from weightstream.streaming.bucket import Bucket
from weightstream.streaming.plan import plan_buckets
from weightstream.streaming.stream import DEFAULT_BUCKET_BYTES, BucketStream, StreamStats, stream_hf_weights
from weightstream.wire.fp8 import FP8, SCALE_SUFFIX, BlockFP8

__all__ = ["DEFAULT_SHARD_BYTES", "SafetensorsFileWriter", "CheckpointReport", "SafetensorsSink", "save_hf_checkpoint"]


DEFAULT_SHARD_BYTES = 4 << 30

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class SafetensorsFileWriter:
    """Writes one safetensors file whose tensors (and their order) are known up front."""

    def __init__(self, path: Path, entries: Sequence[_Entry]):
        self.path = path
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self.expected: dict[str, tuple[int, int]] = {}
        for e in entries:
            header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            self.expected[e.name] = (offset, e.nbytes)
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.size = offset
        self.written = 0
        self.order = [e.name for e in entries]
        self._next = 0
        self.file: BinaryIO = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(raw)))
        self.file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.order) or self.order[self._next] != name:
            raise RuntimeError(f"{self.path.name}: got {name!r} out of order")
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if data.device.type != "cpu":
            data = data.cpu()
        self.file.write(data.numpy().data)  # a memoryview of the array: its bytes, uncopied
        self.written += data.numel()
        self._next += 1

    def close(self) -> None:
        self.file.close()
        if self._next != len(self.order) or self.written != self.size:
            raise RuntimeError(f"{self.path.name}: incomplete ({self._next}/{len(self.order)} tensors)")

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # closing flushes, which fails again on a full or failing disk
            self.file.close()
        self.path.unlink(missing_ok=True)


@dataclass
class CheckpointReport:
    directory: Path
    files: list[str]
    tensors: int
    total_size: int
    stats: StreamStats
    entries: list = field(default_factory=list, repr=False)  # name, dtype, shape, bytes of every tensor written
    copied: list[str] = field(default_factory=list)  # the model directory's other files, copied beside the shards

    def sizes(self) -> dict[str, int]:
        """Bytes of each tensor written, by name."""
        return {e.name: e.nbytes for e in self.entries}

    def copied_line(self) -> str:
        """What was copied beside the shards, in one line."""
        if not self.copied:
            return "copied beside the shards: nothing (no model directory, or it holds only weights and config.json)"
        return f"copied beside the shards: {', '.join(self.copied)}"


class SafetensorsSink:
    """The disk as a sink: HF safetensors shards, index and ``config.json``, written as buckets arrive, and the
    other files of the model directory ``hf_config`` names (none where it is a config object or a dict).

    Called on every rank like the other sinks. ``writers="rank0"``: global rank 0 writes every file;
    ``writers="spread"``: file i is written by rank ``i % world_size`` (every rank receives every
    bucket of a full stream). The shard plan is made in ``open`` from the stream's tensor list, so
    every header is written before its data.

    ``open``: rank 0 checks the output directory (a non-empty one is refused unless ``overwrite``), clears
    what killed runs left beside it and makes the staging directory that every rank writes into; its
    refusal is raised on every rank. ``close``: once every rank's files are closed, rank 0 writes
    ``config.json`` and the index and moves the directory into place; its outcome is shared with every rank.
    ``abort``: the staging directory is removed. An I/O error is an :class:`OutputDirectoryError` naming the
    output directory, the file and the cause."""

    name = "safetensors"

    def __init__(self, out_dir: str | os.PathLike, hf_config: Any, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 writers: str = "rank0", overwrite: bool = False):
        if writers not in ("rank0", "spread"):
            raise ValueError(f"writers must be 'rank0' or 'spread', got {writers!r}")
        self.out = Path(out_dir)
        self.cfg = load_hf_config(hf_config)
        directory = os.fspath(hf_config) if isinstance(hf_config, (str, os.PathLike)) else None
        self.extra_files: list[Path] = non_weight_files(directory) if directory is not None else []
        self.shard_bytes, self.writers, self.overwrite = shard_bytes, writers, overwrite
        self.staged: StagedDirectory | None = None
        self._pinned: torch.Tensor | None = None  # pinned host buffer for buckets on a GPU
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.open_files: dict[int, SafetensorsFileWriter] = {}

    def prepare(self, stream: BucketStream) -> None:
        """Nothing ahead: the files are planned when a stream opens."""

    def connect(self) -> None:
        """Nothing to connect: the files are this process's own."""

    def disconnect(self, seconds: float | None = None) -> None:
        """Nothing held between streams."""

    def delivery(self) -> Delivery:
        return Delivery()

    def share_digests(self) -> None:
        """Nothing: a checkpoint on disk takes no deltas."""

    def open(self, stream: BucketStream) -> None:
        if stream.mode != "full":
            raise ValueError("a checkpoint holds whole tensors: it needs a full stream")
        self.entries = [_Entry(o.name, o.dtype, o.shape, o.nbytes) for it in stream.items for o in it.outputs]
        self.quantization = stream.quantization
        self.files = plan_buckets([[e.nbytes] for e in self.entries], self.shard_bytes, align=1)
        self.names = [shard_name(i + 1, len(self.files)) for i in range(len(self.files))]
        self.mine = {i for i in range(len(self.files))
                     if (i % self.world if self.writers == "spread" else 0) == self.rank}
        self.file_of = {self.entries[j].name: i for i, f in enumerate(self.files) for j in f.items}
        self.remaining = {i: len(self.files[i].items) for i in self.mine}
        made: StagedDirectory | WeightstreamError | None = None
        if self.rank == 0:
            try:
                made = StagedDirectory.create(self.out, overwrite=self.overwrite)
            except OutputDirectoryError as exc:
                made = exc
        made = self._from_rank0(made)
        if isinstance(made, WeightstreamError):
            raise made
        self.staged = made

    def _staging(self) -> StagedDirectory:
        """The staging directory ``open`` made, until ``close`` moves it into place."""
        if self.staged is None:
            raise RuntimeError("the checkpoint sink is not open")
        return self.staged

    def _from_rank0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (the value itself in a job of one)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _on_host(self, bucket):
        """The bucket in host memory: one copy of its whole buffer into a pinned buffer kept by the
        sink (grown as needed), instead of a device-to-host copy per tensor."""
        buffer = bucket.buffer
        if buffer.device.type == "cpu":
            return bucket
        pinned = self._pinned
        if pinned is None or pinned.numel() < buffer.numel():
            pinned = self._pinned = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
        host = pinned.narrow(0, 0, buffer.numel())
        host.copy_(buffer, non_blocking=True)
        torch.cuda.current_stream(buffer.device).synchronize()
        return Bucket(bucket.index, host, bucket.metas)

    def wants(self, metas) -> bool:
        """Whether a bucket holding ``metas`` has tensors of this rank's files."""
        return any(self.file_of[m.name] in self.mine for m in metas)

    def send(self, bucket: Bucket) -> None:
        if not self.wants(bucket.metas):
            return
        for name, tensor in self._on_host(bucket).named_tensors():
            i = self.file_of[name]
            if i not in self.mine:
                continue
            path = self._staging().path / self.names[i]
            with writing(self.out, path):
                if i not in self.open_files:
                    self.open_files[i] = SafetensorsFileWriter(path, [self.entries[j] for j in self.files[i].items])
                self.open_files[i].write(name, tensor)
                self.remaining[i] -= 1
                if self.remaining[i] == 0:
                    self.open_files.pop(i).close()

    def close(self) -> None:
        if self.open_files:
            raise RuntimeError(f"files left incomplete: {sorted(self.names[i] for i in self.open_files)}")
        if self.world > 1:
            dist.barrier()  # every rank's files are closed
        failure: WeightstreamError | None = None
        if self.rank == 0:
            try:
                self._finish()
            except OutputDirectoryError as exc:
                failure = exc
        failure = self._from_rank0(failure)
        if failure is not None:
            raise failure

    def _finish(self) -> None:
        """Rank 0: ``config.json`` and the index into the staging directory, then the directory into place."""
        staged = self._staging()
        staging = staged.path
        for path in self.extra_files:
            with writing(self.out, staging / path.name):
                shutil.copyfile(path, staging / path.name)
        with writing(self.out, staging / "config.json"):
            _save_config(self.cfg, staging, _main_dtype(self.entries), self._quantization_config())
        weight_map = {e.name: self.names[self.file_of[e.name]] for e in self.entries}
        index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        with writing(self.out, staging / INDEX_NAME):
            (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        staged.commit()
        self.staged = None

    def abort(self) -> None:
        for w in self.open_files.values():
            w.abort()
        self.open_files.clear()
        self._pinned = None
        if self.rank == 0 and self.staged is not None:
            self.staged.discard()
            self.staged = None

    def _quantization_config(self) -> dict | None:
        """``config.json``'s ``quantization_config`` of a block-FP8 checkpoint (None: not quantized)."""
        q = self.quantization
        if q is None:
            return None
        kept = {e.name: e.shape for e in self.entries if e.dtype != FP8 and not e.name.endswith(SCALE_SUFFIX)}
        return q.fp8.config(q.converter.not_quantized(kept))

    @property
    def total_size(self) -> int:
        return sum(e.nbytes for e in self.entries)


def save_hf_checkpoint(
    model_chunks: nn.Module | Sequence[nn.Module] | Any,
    hf_config: Any,
    out_dir: str | os.PathLike,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    writers: str = "rank0",
    progress: Callable[[int, int], None] | None = None,
    overwrite: bool = False,
    quantize: BlockFP8 | None = None,
) -> CheckpointReport:
    """Write the model as an HF checkpoint (safetensors shards, index, ``config.json``). Call on every rank.
    ``model_chunks``: anything :func:`stream_hf_weights` takes (Megatron-Core chunks, an FSDP2 / DTensor
    transformers model, a source such as a Megatron checkpoint on disk).

    ``hf_config`` given as a model directory: its other files (tokenizer files, ``generation_config.json``, chat
    template, the ``*.py`` of a ``trust_remote_code`` model, ...; never weights or indexes) are copied beside the
    shards, so the output serves as it is; the report's ``copied`` names them.

    The stream into a :class:`SafetensorsSink`: memory is bounded by the stream (two buckets plus
    the largest tensor), whatever the shard size. ``progress(done, total)`` is called after each bucket.

    ``out_dir`` appears complete or not at all: the files go into a directory beside it that is moved into
    place at the end. A non-empty ``out_dir`` is refused (:class:`~weightstream.common.staging.OutputDirectoryError`,
    on every rank) unless ``overwrite``, which replaces it whole in one step; an empty one is fine. A failure
    (an I/O error is an ``OutputDirectoryError`` naming the directory, the file and the cause) leaves
    ``out_dir`` as it was. ``quantize``: the weights the family declares FP8 are written as block FP8 (values
    and ``_scale_inv`` scales), with the matching ``quantization_config`` in ``config.json``.
    """
    sink = SafetensorsSink(out_dir, hf_config, shard_bytes=shard_bytes, writers=writers, overwrite=overwrite)
    stream = stream_hf_weights(model_chunks, sink.cfg, bucket_bytes=bucket_bytes, mode="full", reuse_buffers=True,
                               quantize=quantize)
    sink.open(stream)
    try:
        if stream.source.independent:
            # A rank that reads on its own (a checkpoint on disk) makes only the buckets its files need.
            stream.select = lambda i: sink.wants(stream.bucket_metas(i))
        total = stream.selected()
        for done, bucket in enumerate(stream, 1):
            sink.send(bucket)
            if progress is not None:
                progress(done, total)
        sink.close()
    except BaseException:
        sink.abort()
        raise
    return CheckpointReport(sink.out, sink.names, len(sink.entries), sink.total_size, stream.stats, list(sink.entries),
                            [p.name for p in sink.extra_files])


def _save_config(cfg, out: Path, dtype: torch.dtype | None, quantization: dict | None) -> None:
    import copy

    if isinstance(cfg, ConfigFields):  # a model type transformers does not know: its fields as given
        values: dict[str, Any] = {} if dtype is None else {"dtype": dtype_name(dtype)}
        if quantization is not None:
            values["quantization_config"] = quantization
        cfg.with_fields(**values).save_pretrained(out)
        return

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = copy.deepcopy(cfg)
    if dtype is not None:
        cfg.dtype = dtype_name(dtype)
    if quantization is not None:
        cfg.quantization_config = quantization

    if not cfg.architectures and cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
    cfg.save_pretrained(out)


def _main_dtype(entries: Sequence[_Entry]) -> torch.dtype | None:
    """The dtype that holds the most bytes, block-FP8 values and scales aside (what ``config.json`` should say
    the model is in)."""
    totals: dict[torch.dtype, int] = {}
    for e in entries:
        if e.dtype == FP8 or e.name.endswith(SCALE_SUFFIX):
            continue
        totals[e.dtype] = totals.get(e.dtype, 0) + e.nbytes
    return max(totals, key=totals.__getitem__) if totals else None
