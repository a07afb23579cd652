"""Block FP8 as it crosses to an engine: a 2-D weight ``X.weight`` in ``float8_e4m3fn`` and its float32 scales
``X.weight_scale_inv`` of shape ``[ceil(rows / br), ceil(cols / bc)]``, one per block of ``br × bc``, with
``w ≈ fp8 × scale_inv`` within each block: the layout of the published block-FP8 checkpoints (DeepSeek-V3,
``Qwen3-*-FP8``) and of the engines' block-FP8 loaders, and its ``quantization_config``. The arithmetic that
makes it is :mod:`weightstream.converters.fp8`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["FP8", "ScaleFormat", "SCALE_SUFFIX", "BlockFP8", "block_fp8_of"]


FP8 = torch.float8_e4m3fn
ScaleFormat = Literal["float", "ue8m0"]  # ``ue8m0``: each scale a power of two (exponent-only kernels)
SCALE_SUFFIX = "_scale_inv"  # ``X.weight`` -> ``X.weight_scale_inv``


@dataclass(frozen=True)
class BlockFP8:
    """How weights are quantized: the block (rows, cols) and the scales' format."""

    block: tuple[int, int] = (128, 128)
    scale_fmt: ScaleFormat = "float"

    def __post_init__(self) -> None:
        rows, cols = self.block
        if rows <= 0 or cols <= 0:
            raise ValueError(f"block must be two positive sizes, got {self.block}")
        if self.scale_fmt not in ("float", "ue8m0"):
            raise ValueError(f"scale_fmt must be 'float' or 'ue8m0', got {self.scale_fmt!r}")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The shape of the scales of a weight of ``shape``."""
        if len(shape) != 2:
            raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(shape)}")
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])

    def config(self, not_converted: list[str]) -> dict:
        """The ``quantization_config`` of a checkpoint quantized so (transformers' and the engines' keys)."""
        out: dict = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": list(self.block), "modules_to_not_convert": not_converted}
        if self.scale_fmt == "ue8m0":
            out["scale_fmt"] = "ue8m0"
        return out


def block_fp8_of(quantization_config: dict | None) -> BlockFP8 | None:
    """The block-FP8 layout an HF ``quantization_config`` declares (None: the model is not block FP8)."""
    if not quantization_config or quantization_config.get("quant_method") != "fp8":
        return None
    block = quantization_config.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        return None  # per-tensor FP8: not a block layout
    fmt: ScaleFormat = "ue8m0" if quantization_config.get("scale_fmt") == "ue8m0" else "float"
    return BlockFP8((int(block[0]), int(block[1])), fmt)
