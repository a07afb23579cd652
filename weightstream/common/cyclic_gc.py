"""Python's cyclic garbage collector, paused around work that makes many short-lived objects."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["no_cyclic_gc"]


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic collector paused: making or copying thousands of tensor views (which hold no cycles)
    would otherwise set off collections of the whole heap midway, costing more than the copies."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
