"""A Megatron-Core model's parallel layout (TP, PP, VPP, EP, expert-TP) and the fewest processes that hold it.
Plain data: no torch, so that a command checks a layout before it starts anything."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    @property
    def world_size(self) -> int:
        """The fewest processes that hold this layout: per stage, a multiple of TP (dense) and of
        EP x expert-TP (experts; expert-TP defaults to TP, as in Megatron)."""
        return self.pp * math.lcm(self.tp, self.ep * (self.etp or self.tp))

    def describe(self) -> str:
        parts = [f"TP {self.tp}", f"PP {self.pp}"]
        if self.vpp and self.vpp > 1:
            parts.append(f"VPP {self.vpp}")
        if self.ep > 1:
            parts.append(f"EP {self.ep}")
        if self.etp and self.etp > 1:
            parts.append(f"ETP {self.etp}")
        return " × ".join(parts)
