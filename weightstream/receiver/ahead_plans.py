"""The broadcast plans an engine keeps: every bucket's metadata of an update sent ahead, by a key the engine derives
from what it decoded, so that a trainer whose next update has the same plan sends the key alone.

A Qwen3-30B-A3B update names 18,867 tensors; their names, dtypes and shapes encoded, sent, parsed, checked and
decoded again on every update cost tens of milliseconds on both sides, all of it before the first bucket can be
received. The engine answers the first update's request with its key for the plan (:func:`plan_key`) and names the
keys it holds when a session begins; the trainer sends a key only where the engine named it at that begin. The key
is the engine's own digest of the decoded buckets, never a digest the trainer claims: a key names exactly the
buckets that were checked when it was made."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence

from weightstream.receiver.plan import DenseBucket

__all__ = ["KEPT_AHEAD_PLANS", "plan_key", "AheadPlans"]

KEPT_AHEAD_PLANS = 4  # plans kept per engine (trainers with other layouts, a resharded one, a quantized one)


def plan_key(buckets: Sequence[DenseBucket]) -> str:
    """The digest of ``buckets``' metadata (each bucket's names, dtype names and shapes, in order)."""
    h = hashlib.sha256()
    for b in buckets:  # (JSON: no two different buckets encode alike, whatever their names hold)
        h.update(json.dumps([b.names, b.dtypes, b.shapes]).encode())
    return h.hexdigest()[:32]


class AheadPlans:
    """The plans kept, least recently used dropped first beyond ``capacity``. Only a plan whose update loaded is
    put here (a refused or failed request leaves nothing)."""

    def __init__(self, capacity: int = KEPT_AHEAD_PLANS):
        self.capacity = max(capacity, 1)
        self._plans: OrderedDict[str, tuple[DenseBucket, ...]] = OrderedDict()

    def keys(self) -> list[str]:
        """The keys held, oldest first (what a session's begin answers with)."""
        return list(self._plans)

    def get(self, key: str) -> tuple[DenseBucket, ...] | None:
        """The buckets kept under ``key`` (now the most recently used), or None."""
        buckets = self._plans.get(key)
        if buckets is not None:
            self._plans.move_to_end(key)
        return buckets

    def put(self, key: str, buckets: tuple[DenseBucket, ...]) -> None:
        self._plans[key] = buckets
        self._plans.move_to_end(key)
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()
