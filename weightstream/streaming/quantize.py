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

from weightstream.converters.fp8 import FP8, SCALE_SUFFIX, BlockFP8, cast_blocks
from weightstream.converters.mapping import Converter
from weightstream.converters.ops import OpContext, TensorOp
from weightstream.errors import ConversionError
from weightstream.sources.table import HFOut
from weightstream.streaming import fp8_cast
from weightstream.streaming.bucket import Shard
from weightstream.streaming.fp8_cast import BlockCast, CastJob

__all__ = ["Quantization", "convert_quantized", "block_cast", "QuantizeBatch"]


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
    (:class:`~weightstream.streaming.fp8_cast.BlockCast`), whole-tensor operations elsewhere. Either way the
    arithmetic of :func:`~weightstream.converters.fp8.quantize_block_fp8`, bit for bit."""
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
    """The jobs whose shapes are whole blocks, per dtype at once (:func:`_cast_gridded`); the others one by one.
    A source whose rows are not one stride apart is reshaped (copied) to its values' shape first."""
    br, bc = fp8.block
    gridded: dict[torch.dtype, list[tuple[Tensor, CastJob]]] = {}
    for job in jobs:
        x = job.source.reshape(job.values.shape)
        if x.shape[0] % br == 0 and x.shape[1] % bc == 0:
            gridded.setdefault(x.dtype, []).append((x, job))
        else:
            q, s = fp8.quantize(x)
            job.values.copy_(q)
            job.scales.view(s.shape).copy_(s)
    for group in gridded.values():
        _cast_gridded(group, fp8)


def _blocks(t: Tensor, block: tuple[int, int]) -> Tensor:
    """A 2-D tensor (any strides) as (row blocks, rows, column blocks, cols)."""
    br, bc = block
    s0, s1 = t.stride()
    return t.as_strided((t.shape[0] // br, br, t.shape[1] // bc, bc), (br * s0, s0, bc * s1, s1), t.storage_offset())


def _cast_gridded(jobs: list[tuple[Tensor, CastJob]], fp8: BlockFP8) -> None:
    """2-D tensors of one dtype whose shapes are whole blocks: each copied block-major into one staging buffer
    (one batched copy), every block's amax, scale and values in a few whole-buffer kernels, and the values and
    scales copied to their places (two batched copies)."""
    br, bc = fp8.block
    grids = [(x.shape[0] // br, x.shape[1] // bc) for x, _ in jobs]
    counts = [r * c for r, c in grids]
    x0 = jobs[0][0]
    staging = torch.empty(sum(counts), br, bc, dtype=x0.dtype, device=x0.device)
    parts = list(staging.split(counts))
    block_major = [p.view(r, c, br, bc).permute(0, 2, 1, 3) for p, (r, c) in zip(parts, grids, strict=True)]
    torch._foreach_copy_(block_major, [_blocks(x, fp8.block) for x, _ in jobs])
    cast, kept = cast_blocks(staging, (1, 2), ue8m0=fp8.scale_fmt == "ue8m0")
    values, scale = cast.view(torch.uint8), kept.view(-1)
    torch._foreach_copy_([_blocks(j.values.view(torch.uint8), fp8.block) for _, j in jobs],
                         [p.view(r, c, br, bc).permute(0, 2, 1, 3)
                          for p, (r, c) in zip(values.split(counts), grids, strict=True)])
    torch._foreach_copy_([j.scales.view(-1) for _, j in jobs], list(scale.split(counts)))
