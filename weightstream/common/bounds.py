"""Bounded waits: one deadline shared by the steps of a phase, so that a phase with several waits
still ends within its bound."""

from __future__ import annotations

import time
from datetime import timedelta

__all__ = ["Deadline", "cleanup_budget"]


class Deadline:
    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.end = time.monotonic() + self.seconds

    def remaining(self, floor: float = 0.05) -> float:
        """Seconds left (at least ``floor``, so that a last attempt still gets a moment)."""
        return max(floor, self.end - time.monotonic())

    def timedelta(self) -> timedelta:
        return timedelta(seconds=self.remaining())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.end


def cleanup_budget(timeout_s: float) -> float:
    """What tearing down a failed update may take after the failure was seen: the whole update then
    ends within ``1.2 * timeout_s + 5`` seconds of the wait that failed."""
    return 0.1 * timeout_s + 2.0
