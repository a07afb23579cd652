"""Block FP8's arithmetic: a 2-D weight as ``float8_e4m3fn`` values and one float32 scale per block, in the
layout :mod:`weightstream.wire.fp8` describes (``X.weight_scale_inv``: the name is historical, it is the inverse
of the quantization scale ``448 / amax``).

The arithmetic is DeepGEMM's ``per_block_cast_to_fp8`` (vLLM's copy and its ``fp8_per_block`` online method
compute the same; SGLang's is the same with power-of-two scales) as it runs on a GPU: the ragged edge padded
with zeros, ``amax`` per block in float32 clamped to ``1e-4``, ``scale = amax × fp32(1/448)`` (what CUDA
computes for ``amax / 448``; a CPU's true division differs by one ulp on about half the blocks, so the product
is written out and the bits are the same on either device), ``fp8 = (x × (1 / scale))`` cast to e4m3.
``ue8m0``: each scale rounded up to a power of two from its bits (DeepGEMM's ``ceil_to_ue8m0``), for engines
whose kernels take exponent-only scales.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from weightstream.wire.fp8 import FP8, BlockFP8

__all__ = [
    "FP8_MAX", "MIN_AMAX", "quantize_weight", "ceil_to_ue8m0", "quantize_block_fp8", "quantize_block_fp8_grouped",
    "cast_blocks", "dequantize_block_fp8"
]


FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_AMAX = 1e-4  # an all-zero block's amax (its scale then 1e-4 / 448)


def quantize_weight(fp8: BlockFP8, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``weight`` (2-D, any float dtype) as (fp8 values of its shape, float32 scales), in ``fp8``'s layout."""
    return quantize_block_fp8(weight, fp8.block, ue8m0=fp8.scale_fmt == "ue8m0")


def _two_dims(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(shape)}")
    return shape[0], shape[1]


def ceil_to_ue8m0(scale: Tensor) -> Tensor:
    """Each positive float32 ``scale`` rounded up to a power of two, from its bits (exact)."""
    bits = scale.abs().float().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def quantize_block_fp8(weight: Tensor, block: tuple[int, int] = (128, 128), *,
                       ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """``weight`` as (``float8_e4m3fn`` values of its shape, float32 scales ``[ceil(rows/br), ceil(cols/bc)]``);
    see the module's doc for the arithmetic."""
    rows, cols = _two_dims(tuple(weight.shape))
    br, bc = block
    grid = (math.ceil(rows / br), math.ceil(cols / bc))
    padded = weight
    if rows % br or cols % bc:
        padded = weight.new_zeros(grid[0] * br, grid[1] * bc)
        padded[:rows, :cols] = weight
    values, scale = cast_blocks(padded.view(grid[0], br, grid[1], bc), (1, 3), ue8m0=ue8m0)
    return values.view(grid[0] * br, grid[1] * bc)[:rows, :cols].contiguous(), scale.view(grid)


def quantize_block_fp8_grouped(weights: Tensor, block: tuple[int, int] = (128, 128), *,
                               ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """Same-shaped weights stacked as ``[group, rows, cols]`` (a layer's experts of one projection), quantized at
    once: (``float8_e4m3fn`` values ``[group, rows, cols]``, float32 scales ``[group, ceil(rows/br),
    ceil(cols/bc)]``), each weight's bit for bit those of :func:`quantize_block_fp8` on it alone (the same
    elementwise arithmetic; a block's amax is exact in any order, and the zeros a ragged block is padded with
    change no amax: a weight narrower than a block is not padded to it)."""
    if weights.dim() != 3:
        raise ValueError(f"grouped block FP8 quantizes [group, rows, cols], got shape {tuple(weights.shape)}")
    group, rows, cols = weights.shape
    br, bc = max(1, min(block[0], rows)), max(1, min(block[1], cols))  # a weight within one block: the block
    grid = (math.ceil(rows / br), math.ceil(cols / bc))
    padded = weights
    if rows % br or cols % bc:
        padded = weights.new_zeros(group, grid[0] * br, grid[1] * bc)
        padded[:, :rows, :cols] = weights
    values, scale = cast_blocks(padded.view(group, grid[0], br, grid[1], bc), (2, 4), ue8m0=ue8m0)
    values = values.view(group, grid[0] * br, grid[1] * bc)
    if values.shape[1:] != (rows, cols):
        values = values[:, :rows, :cols].contiguous()
    return values, scale.view(group, *grid)


def cast_blocks(blocks: Tensor, dims: tuple[int, int], *, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """Values laid out in blocks (``dims``: the two dimensions within a block) as (``float8_e4m3fn`` values of
    the same layout, float32 scales with those dimensions kept as 1): the arithmetic of the module's doc. The
    amax is taken in the values' own dtype (absolute values and maxima are exact) and widened after."""
    amax = blocks.abs().amax(dim=dims, keepdim=True).float().clamp(MIN_AMAX)
    scale = amax * (1.0 / FP8_MAX)
    if ue8m0:
        scale = ceil_to_ue8m0(scale)
    return (blocks * (1.0 / scale)).to(FP8), scale


def dequantize_block_fp8(values: Tensor, scale: Tensor, block: tuple[int, int] = (128, 128), *,
                         dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``fp8 × scale`` per block, in ``dtype`` (what a checkpoint loader that dequantizes computes)."""
    rows, cols = _two_dims(tuple(values.shape))
    expanded = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return (values.float() * expanded).to(dtype)
