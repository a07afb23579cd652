"""``convert_checkpoint``: a Megatron-Core checkpoint on disk -> an HF checkpoint, in one process.

The checkpoint is read tensor by tensor (:class:`~weightstream.sources.megatron_checkpoint.MegatronCheckpointSource`)
and streamed through the same planner, converter and safetensors writer as a live model, so the whole model
is never held: memory stays within a bucket or two plus the largest tensor.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightstream.checks.compare import Comparison, compare_checkpoints
from weightstream.common.staging import check_target, clean_leftovers
from weightstream.errors import WeightstreamError
from weightstream.models.spec import load_hf_config
from weightstream.sinks.safetensors import DEFAULT_SHARD_BYTES, CheckpointReport, save_hf_checkpoint
from weightstream.sources.megatron_checkpoint import MegatronCheckpointSource
from weightstream.wire.fp8 import BlockFP8

__all__ = ["DEFAULT_CONVERT_BUCKET_BYTES", "ConvertReport", "convert_checkpoint"]


DEFAULT_CONVERT_BUCKET_BYTES = 256 << 20


@dataclass
class ConvertReport:
    out: Path
    format: str  # "torch_dist" or "legacy"
    iteration: int | str | None
    tensors: int
    bytes: int
    files: int
    seconds: float
    rss_before: int  # bytes of resident memory when the conversion started
    peak_rss: int  # the process's peak resident memory (bytes), which the conversion may have raised
    largest_tensor: tuple[str, int]  # name, bytes
    largest_layer: tuple[str, int]  # "model.layers.N", bytes of its HF tensors
    verify: Comparison | None = None
    copied: list[str] = field(default_factory=list)  # the HF directory's other files, copied beside the shards

    def summary(self) -> str:
        gb = self.bytes / 1e9
        line = (f"{self.format} checkpoint (iteration {self.iteration}) -> {self.out}: {self.tensors} tensors, "
                f"{gb:.2f} GB in {self.files} files, {self.seconds:.1f} s ({gb / max(self.seconds, 1e-9):.2f} GB/s); "
                f"peak RSS {self.peak_rss / 1e9:.2f} GB ({self.rss_before / 1e9:.2f} GB before), largest layer "
                f"{self.largest_layer[0]} {self.largest_layer[1] / 1e9:.3f} GB, "
                f"largest tensor {self.largest_tensor[0]} {self.largest_tensor[1] / 1e9:.3f} GB")
        line += "; " + (f"copied beside the shards: {', '.join(self.copied)}" if self.copied
                        else "nothing copied beside the shards (no tokenizer or other files in the HF directory)")
        if self.verify is not None:
            line += "; verify: " + ("identical" if self.verify.ok else "DIFFERENT")
        return line


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def convert_checkpoint(
    checkpoint: str | os.PathLike,
    hf_config: Any,
    out_dir: str | os.PathLike,
    *,
    iteration: int | str | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_CONVERT_BUCKET_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[int, int], None] | None = None,
    verify: str | os.PathLike | None = None,
    procs: int = 1,
    overwrite: bool = False,
    trust_checkpoint: bool = False,
    quantize: BlockFP8 | None = None,
) -> ConvertReport:
    """Write the Megatron-Core checkpoint at ``checkpoint`` (distributed ``torch_dist`` or legacy per-rank
    format, any TP/PP/VPP/EP layout; the save directory or one iteration's) as an HF checkpoint in ``out_dir``.

    ``hf_config``: the HF config of the model (a directory, a transformers config or a dict); every shape
    of the checkpoint is checked against it and every mismatch listed in one error. A directory's other files
    (tokenizer, ``generation_config.json``, chat template, ...) are copied beside the shards (the report's
    ``copied``). A model type transformers does not know converts once a converter is registered for it.
    ``iteration``: which one (default: the one ``latest_checkpointed_iteration.txt`` names). ``dtype``: cast
    floating tensors.
    ``verify``: an HF checkpoint to compare the result with, tensor by tensor (bit for bit). ``procs``: local
    processes sharing the work (each reads only what its safetensors files hold; ``peak_rss`` is then the
    largest of theirs).

    ``quantize``: write the weights the family declares FP8 as block FP8 (see :func:`save_hf_checkpoint`).

    ``out_dir`` appears complete or not at all (see :func:`~weightstream.save_hf_checkpoint`); a non-empty one
    is refused unless ``overwrite``, which replaces it whole.

    Read only checkpoints you trust. A checkpoint is pickled, and a pickle can run any code: by default a file
    naming a global that Megatron does not save there is refused (one error naming the globals and the file);
    ``trust_checkpoint=True`` reads it anyway, letting it run whatever it holds. Tensor data is checked against
    the CRC-32s torch's zip format records for it; ``verify`` is the end-to-end check.
    """
    start = time.perf_counter()
    rss_before = _rss()
    check_target(Path(os.path.realpath(out_dir)), overwrite=overwrite)  # before reading anything
    _read_hf_config(hf_config)  # a config that cannot be read fails here, once
    if procs > 1:
        report, fmt, it, peak = _convert_in_processes(procs, checkpoint, hf_config, out_dir, iteration, dtype,
                                                      bucket_bytes, shard_bytes, overwrite, trust_checkpoint,
                                                      quantize)
    else:
        report, fmt, it, peak = _convert_rank(checkpoint, hf_config, out_dir, iteration, dtype, bucket_bytes,
                                              shard_bytes, progress, overwrite, trust_checkpoint, quantize)
    out = _convert_report(report, Path(out_dir), fmt, it, time.perf_counter() - start, rss_before, peak)
    if verify is not None:
        out.verify = compare_checkpoints(verify, out_dir)
    return out


def _convert_report(report: CheckpointReport, out_dir: Path, fmt: str, it: int | str | None, seconds: float,
                    rss_before: int, peak: int) -> ConvertReport:
    """What a conversion wrote, with its largest tensor and its largest layer."""
    layers: dict[str, int] = {}
    largest = ("", 0)
    for name, nbytes in report.sizes().items():
        if nbytes > largest[1]:
            largest = (name, nbytes)
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers":
            key = ".".join(parts[:3])
            layers[key] = layers.get(key, 0) + nbytes
    layer = max(layers.items(), key=lambda kv: kv[1]) if layers else ("", 0)
    return ConvertReport(out_dir, fmt, it, report.tensors, report.total_size, len(report.files), seconds,
                         rss_before, peak, largest, layer, copied=list(report.copied))


def _read_hf_config(hf_config: Any) -> Any:
    """The transformers config ``hf_config`` names; one WeightstreamError line when it cannot be read."""
    try:
        return load_hf_config(hf_config)
    except (OSError, ValueError, KeyError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise WeightstreamError(f"the HF config {hf_config} cannot be read: "
                                f"{lines[0] if lines else type(exc).__name__}") from None


def _convert_in_processes(procs, checkpoint, hf_config, out_dir, iteration, dtype, bucket_bytes, shard_bytes,
                          overwrite, trust_checkpoint, quantize):
    """``_convert_rank`` on ``procs`` local processes: (rank 0's report, format, iteration, the largest peak RSS).
    A rank's WeightstreamError is raised here as one; what killed ranks left beside ``out_dir`` is removed."""
    from weightstream.launch import LaunchError, launch

    # A bad path or a refused file fails here, once.
    MegatronCheckpointSource(checkpoint, iteration=iteration, trust_checkpoint=trust_checkpoint).close()
    try:
        results = launch(procs, _convert_rank, checkpoint, hf_config, os.fspath(out_dir), iteration, dtype,
                         bucket_bytes, shard_bytes, None, overwrite, trust_checkpoint, quantize, backend="gloo",
                         timeout_s=24 * 3600.0)
    except LaunchError as exc:
        clean_leftovers(Path(os.path.realpath(out_dir)))
        if exc.reasons:
            raise WeightstreamError(exc.reasons[min(exc.reasons)]) from exc
        raise
    return results[0][0], results[0][1], results[0][2], max(r[3] for r in results)


def _convert_rank(checkpoint, hf_config, out_dir, iteration, dtype, bucket_bytes, shard_bytes, progress=None,
                  overwrite=False, trust_checkpoint=False, quantize=None):
    """One process's part (all of it when alone): (report, format, iteration, peak RSS)."""
    import torch.distributed as dist

    source = MegatronCheckpointSource(checkpoint, iteration=iteration, dtype=dtype, trust_checkpoint=trust_checkpoint)
    writers = "spread" if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else "rank0"
    try:
        report = save_hf_checkpoint(source, hf_config, out_dir, bucket_bytes=bucket_bytes, shard_bytes=shard_bytes,
                                    progress=progress, writers=writers, overwrite=overwrite, quantize=quantize)
    finally:
        source.close()
    return report, source.format, source.iteration, _peak_rss()
