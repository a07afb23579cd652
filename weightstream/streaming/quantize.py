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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from weightstream.converters.fp8 import FP8, SCALE_SUFFIX, BlockFP8, cast_blocks
from weightstream.converters.mapping import Converter
from weightstream.converters.ops import OpContext, TensorOp
from weightstream.errors import ConversionError
from weightstream.sources.table import HFOut
from weightstream.streaming.bucket import Shard


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


def convert_quantized(op: TensorOp, tensor: Tensor, ctx: OpContext, flags: Sequence[bool], fp8: BlockFP8,
                      targets: Sequence[Tensor], batch: QuantizeBatch) -> None:
    """``op.to_hf(tensor)`` into ``targets``: each quantized output as its values and then its scales (queued in
    ``batch`` where its shape is a whole number of blocks, quantized now otherwise), the others as they are."""
    it = iter(targets)
    for out, quantized in zip(op.to_hf(tensor, ctx), flags, strict=True):
        if not quantized:
            next(it).view(out.shape).copy_(out)
            continue
        values, scales = next(it), next(it)
        if batch.takes(out):
            batch.add(out, values, scales)
        else:
            q, s = fp8.quantize(out)
            values.copy_(q)
            scales.copy_(s)


class QuantizeBatch:
    """The quantized tensors of one bucket, quantized together: each copied block-major into one staging
    buffer per dtype (one batched copy), then every block's amax, scale and values in a few whole-buffer
    kernels, and the values and scales copied to their places in the bucket (two batched copies). The same
    arithmetic as :func:`~weightstream.converters.fp8.quantize_block_fp8`, bit for bit."""

    def __init__(self, fp8: BlockFP8):
        self.fp8 = fp8
        self._queued: dict[torch.dtype, list[tuple[Tensor, Tensor, Tensor]]] = {}

    def takes(self, x: Tensor) -> bool:
        br, bc = self.fp8.block
        return x.dim() == 2 and x.shape[0] % br == 0 and x.shape[1] % bc == 0

    def add(self, x: Tensor, values: Tensor, scales: Tensor) -> None:
        self._queued.setdefault(x.dtype, []).append((x, values, scales))

    def run(self) -> None:
        for queued in self._queued.values():
            self._quantize(queued)
        self._queued.clear()

    def _blocks(self, t: Tensor) -> Tensor:
        """A 2-D tensor (any strides) as (row blocks, rows, column blocks, cols)."""
        br, bc = self.fp8.block
        s0, s1 = t.stride()
        return t.as_strided((t.shape[0] // br, br, t.shape[1] // bc, bc), (br * s0, s0, bc * s1, s1),
                            t.storage_offset())

    def _quantize(self, queued: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        br, bc = self.fp8.block
        grids = [(x.shape[0] // br, x.shape[1] // bc) for x, _, _ in queued]
        counts = [r * c for r, c in grids]
        x0 = queued[0][0]
        staging = torch.empty(sum(counts), br, bc, dtype=x0.dtype, device=x0.device)
        parts = list(staging.split(counts))
        block_major = [p.view(r, c, br, bc).permute(0, 2, 1, 3) for p, (r, c) in zip(parts, grids, strict=True)]
        torch._foreach_copy_(block_major, [self._blocks(x) for x, _, _ in queued])
        cast, kept = cast_blocks(staging, (1, 2), ue8m0=self.fp8.scale_fmt == "ue8m0")
        values, scale = cast.view(torch.uint8), kept.view(-1)
        torch._foreach_copy_([self._blocks(v.view(torch.uint8)) for _, v, _ in queued],
                             [p.view(r, c, br, bc).permute(0, 2, 1, 3)
                              for p, (r, c) in zip(values.split(counts), grids, strict=True)])
        torch._foreach_copy_([s.view(-1) for _, _, s in queued], list(scale.split(counts)))
