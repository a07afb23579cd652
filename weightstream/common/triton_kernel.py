"""A Triton kernel built on first use, on CUDA devices where Triton is present."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LazyKernel"]


class LazyKernel:
    """``build(triton, triton.language)``, made on the first call and kept; None where Triton cannot be imported.
    ``switch``: an environment variable that, set to ``0``, keeps its callers on their torch path."""

    def __init__(self, build: Callable[[Any, Any], Any], switch: str):
        self.build = build
        self.switch = switch
        self.made: list[Any] = []

    def __call__(self) -> Any:
        if not self.made:
            try:
                import triton
                import triton.language as tl
            except ImportError:
                self.made.append(None)
            else:
                self.made.append(self.build(triton, tl))
        return self.made[0]

    def available(self, device: torch.device) -> bool:
        """On ``device``: a CUDA device, Triton present, and the switch not set to ``0``."""
        if device.type != "cuda" or os.environ.get(self.switch, "1") == "0":
            return False
        return self() is not None
