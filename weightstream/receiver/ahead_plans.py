"""The broadcast plans an engine keeps: every bucket's metadata of an update sent ahead, by a key the engine derives
from what it decoded, so that a trainer whose next update has the same plan sends the key alone.

A Qwen3-30B-A3B update names 18,867 tensors; their names, dtypes and shapes encoded, sent, parsed, checked and
decoded again on every update cost tens of milliseconds on both sides, all of it before the first bucket can be
received. The engine answers the first update's request with its key for the plan (:func:`plan_key`) and names the
keys it holds when a session begins; the trainer sends a key only where the engine named it at that begin. The key
is the engine's own digest of the decoded buckets, never a digest the trainer claims: a key names exactly the
buckets that were checked when it was made.

The engine's ranks keep plans by the same keys (:class:`HeldPlan`: the buckets, and the copy programs made for them),
so that a warm update crosses to each rank as its key alone (:class:`KeyedReceive`), not as every bucket's metadata
pickled, sent and looked up again bucket by bucket. Each rank names the keys it holds in its answer to every keyed
receive and prepare; the engine sends a rank the key alone only where that rank's last answer named it."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from weightstream.receiver.plan import DenseBucket, Receive
from weightstream.receiver.programs import CopyProgram

__all__ = ["KEPT_AHEAD_PLANS", "plan_key", "AheadPlans", "KeyedReceive", "HeldPlan"]

P = TypeVar("P")

KEPT_AHEAD_PLANS = 4  # plans kept per engine (trainers with other layouts, a resharded one, a quantized one)


def plan_key(buckets: Sequence[DenseBucket]) -> str:
    """The digest of ``buckets``' metadata (each bucket's names, dtype names and shapes, in order)."""
    h = hashlib.sha256()
    for b in buckets:  # (JSON: no two different buckets encode alike, whatever their names hold)
        h.update(json.dumps([b.names, b.dtypes, b.shapes]).encode())
    return h.hexdigest()[:32]


class AheadPlans(Generic[P]):
    """The plans kept (the engine's: each plan's buckets; a rank's: :class:`HeldPlan`), least recently used dropped
    first beyond ``capacity``. Only a plan whose update loaded, or that was prepared, is put here (a refused or
    failed request leaves nothing)."""

    def __init__(self, capacity: int = KEPT_AHEAD_PLANS):
        self.capacity = max(capacity, 1)
        self._plans: OrderedDict[str, P] = OrderedDict()

    def __len__(self) -> int:
        return len(self._plans)

    def keys(self) -> list[str]:
        """The keys held, oldest first (what a session's begin answers with)."""
        return list(self._plans)

    def values(self) -> list[P]:
        return list(self._plans.values())

    def get(self, key: str) -> P | None:
        """The plan kept under ``key`` (now the most recently used), or None."""
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def put(self, key: str, plan: P) -> None:
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()


@dataclass(frozen=True, slots=True)
class KeyedReceive:
    """One rank's command for a broadcast sent ahead (or prepared: ``receive.prepare``) whose plan the engine keeps
    by ``key``. ``by_key``: the rank's last answer named ``key`` among the plans it holds, and ``receive`` names no
    bucket (the rank takes those it keeps; one that keeps none by ``key`` refuses, naming the keys it holds); else
    ``receive`` names the plan's buckets, which the rank keeps under ``key`` once they have loaded or been
    prepared."""

    key: str
    receive: Receive
    by_key: bool = False

    def __post_init__(self) -> None:
        if self.by_key and self.receive.buckets:
            raise ValueError(f"a receive by key {self.key} names {len(self.receive.buckets)} buckets: it names none")


@dataclass(slots=True)
class HeldPlan:
    """A plan a rank keeps: its ``buckets``, and their copy programs while the weights stay where they were when the
    programs were made (None: made again at the plan's next use; the programs hold views of the weights, which a
    release of the weights' memory takes away)."""

    buckets: tuple[DenseBucket, ...]
    programs: tuple[CopyProgram, ...] | None = None
