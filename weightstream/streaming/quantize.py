"""A stream's block-FP8 quantization: which HF tensors leave as (float8 values, float32 scales), and how.

Each HF tensor the family declares FP8 (:attr:`Converter.fp8`) becomes two tensors in the bucket, side by
side: ``X.weight`` in ``float8_e4m3fn`` and ``X.weight_scale_inv`` in float32, one scale per block
(:mod:`weightstream.converters.fp8`). A per-rank shard is quantized on its own; its blocks are the whole
tensor's only where it starts on a block boundary (and ends on one, or at the tensor's end): any other shard
is refused when the stream is made, naming each, before a byte moves. The scale's placement follows the
weight's, in blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from weightstream.converters.fp8 import quantize_block_fp8_grouped
from weightstream.converters.mapping import Converter
from weightstream.converters.ops import OpContext, TensorOp
from weightstream.errors import ConversionError
from weightstream.sources.table import HFOut
from weightstream.streaming import fp8_cast
from weightstream.streaming.bucket import Shard
from weightstream.streaming.fp8_cast import BlockCast, CastJob
from weightstream.wire.fp8 import FP8, SCALE_SUFFIX, BlockFP8

__all__ = ["Quantization", "convert_quantized", "block_cast", "QuantizeBatch", "GROUP_BYTES"]


# The most source bytes quantized in one set of whole-tensor operations, by device type (others: "*"). On a CPU a
# run whose float32 temporaries (a few times its bytes) stay in the caches: 16 experts of a Qwen3-30B-A3B layer
# (48 tensors, 151 MB of bf16) took 294 ms of CPU time in runs of 4 MiB, 754 ms in runs of 64 MiB and 314 ms one
# tensor at a time (one thread, this project's 2-core test machine). Elsewhere runs long enough that the dozen
# kernel launches of a run are amortized.
GROUP_BYTES = {"cpu": 4 << 20, "*": 256 << 20}


@dataclass(frozen=True)
class Quantization:
    """Block FP8 for one family: its declaration and the block and scale format asked for."""

    fp8: BlockFP8
    converter: Converter

    @classmethod
    def of(cls, fp8: BlockFP8, converter: Converter) -> Quantization:
        if not converter.fp8:
            raise ConversionError(f"cannot quantize {converter.model_type} to block FP8",
                                  {"family without an FP8 declaration": [
                                      f"the {converter.model_type} converter declares no FP8 weights (Converter.fp8)"]})
        return cls(fp8, converter)

    def flags(self, outputs: Sequence[HFOut]) -> tuple[bool, ...]:
        """Per HF output of an op, whether it is quantized."""
        return tuple(self.converter.quantizes(o.name) for o in outputs)

    def expand(self, outputs: Sequence[HFOut], shards: Sequence[Shard | None],
               ) -> tuple[tuple[HFOut, ...], tuple[Shard | None, ...], list[str]]:
        """The bucket's tensors for an op's ``outputs`` (each quantized one followed by its scales), their
        placements, and what keeps a shard from being quantized in the whole tensor's blocks."""
        out: list[HFOut] = []
        placed: list[Shard | None] = []
        problems: list[str] = []
        for o, shard, quantized in zip(outputs, shards, self.flags(outputs), strict=True):
            if not quantized:
                out.append(o)
                placed.append(shard)
                continue
            if len(o.shape) != 2:
                problems.append(f"{o.name}: declared FP8 but has shape {o.shape} (block FP8 quantizes 2-D weights)")
                continue
            out += [HFOut(o.name, o.shape, FP8), HFOut(o.name + SCALE_SUFFIX, self.fp8.scale_shape(o.shape),
                                                       torch.float32)]
            scale, problem = self._scale_shard(o.name, shard)
            placed += [shard, scale]
            if problem:
                problems.append(problem)
        return tuple(out), tuple(placed), problems

    def _scale_shard(self, name: str, shard: Shard | None) -> tuple[Shard | None, str | None]:
        """Where a shard's scales sit in the whole tensor's scales; or why its blocks are not the whole's."""
        if shard is None:
            return None, None
        block = self.fp8.block[shard.dim]
        end = shard.start + shard.length
        if shard.start % block or (shard.length % block and end != shard.full):
            return None, (f"{name}: the shard [{shard.start}, {end}) of dim {shard.dim} (of {shard.full}) does not "
                          f"fall on {block}-wide blocks")
        return Shard(shard.dim, shard.start // block, math.ceil(shard.length / block),
                     math.ceil(shard.full / block)), None


def convert_quantized(op: TensorOp, tensor: Tensor, ctx: OpContext, flags: Sequence[bool],
                      targets: Sequence[Tensor], batch: QuantizeBatch) -> None:
    """``op.to_hf(tensor)`` into ``targets``: each quantized output as its values and then its scales (queued in
    ``batch``), the others as they are."""
    it = iter(targets)
    for out, quantized in zip(op.to_hf(tensor, ctx), flags, strict=True):
        if quantized:
            values, scales = next(it), next(it)
            batch.add(CastJob(out, values, scales))
        else:
            next(it).view(out.shape).copy_(out)


def block_cast(jobs: Sequence[CastJob], fp8: BlockFP8) -> Callable[[], None]:
    """Every job quantized, in one call: one kernel launch per source dtype on a CUDA device with Triton
    (:class:`~weightstream.streaming.fp8_cast.BlockCast`), elsewhere (any device) one set of whole-tensor
    operations per group of same-shaped tensors. Either way the arithmetic of
    :func:`~weightstream.converters.fp8.quantize_block_fp8`, bit for bit."""
    if jobs and fp8_cast.available(jobs[0].source.device):
        return BlockCast(jobs, fp8)
    return partial(_cast_with_torch, list(jobs), fp8)


class QuantizeBatch:
    """The quantized tensors of one bucket, queued as they are converted and quantized together
    (:func:`block_cast`) once the bucket's tensors are all in."""

    def __init__(self, fp8: BlockFP8):
        self.fp8 = fp8
        self._queued: list[CastJob] = []

    def add(self, job: CastJob) -> None:
        self._queued.append(job)

    def run(self) -> None:
        if self._queued:
            block_cast(self._queued, self.fp8)()
        self._queued = []


def _cast_with_torch(jobs: list[CastJob], fp8: BlockFP8) -> None:
    """The jobs in groups of one device, dtype and shape (a layer's experts of one projection; the same
    projection of every layer in the bucket), each group quantized as one ``[group, rows, cols]`` tensor
    (:func:`~weightstream.converters.fp8.quantize_block_fp8_grouped`) in runs of at most :data:`GROUP_BYTES`."""
    groups: dict[tuple[torch.device, torch.dtype, tuple[int, ...]], list[CastJob]] = {}
    for job in jobs:
        groups.setdefault((job.source.device, job.source.dtype, tuple(job.values.shape)), []).append(job)
    for (device, _, shape), group in groups.items():
        most = GROUP_BYTES.get(device.type, GROUP_BYTES["*"])
        step = max(1, most // max(1, math.prod(shape) * group[0].source.element_size()))
        for first in range(0, len(group), step):
            _cast_group(group[first:first + step], fp8)


def _cast_group(jobs: list[CastJob], fp8: BlockFP8) -> None:
    """Jobs of one device, dtype and shape: their sources copied into one ``[group, rows, cols]`` staging tensor
    (one batched copy), quantized in one set of whole-tensor operations, and the values and scales copied to their
    places (two batched copies)."""
    rows, cols = jobs[0].values.shape
    x0 = jobs[0].source
    staging = torch.empty(len(jobs), rows, cols, dtype=x0.dtype, device=x0.device)
    torch._foreach_copy_(list(staging.unbind(0)), [j.source.reshape(rows, cols) for j in jobs])
    values, scales = quantize_block_fp8_grouped(staging, fp8.block, ue8m0=fp8.scale_fmt == "ue8m0")
    del staging
    torch._foreach_copy_([j.values.view(torch.uint8) for j in jobs], list(values.view(torch.uint8).unbind(0)))
    torch._foreach_copy_([j.scales.view(-1) for j in jobs], list(scales.view(len(jobs), -1).unbind(0)))
