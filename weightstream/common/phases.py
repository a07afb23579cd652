"""Seconds per named phase of a piece of work, summed: ``with clock("load"): ...``. Host time: on a GPU a phase
that queues device work ends when the work is queued, so whoever waits for the device names that wait as a phase
of its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PhaseClock"]


class PhaseClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def reset(self) -> dict[str, float]:
        """The phases so far (then none)."""
        out, self.seconds = self.seconds, {}
        return out
