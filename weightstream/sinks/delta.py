"""The trainer's side of delta updates: when an update may send deltas and when it must be full, and the check
after it. Runs on trainer rank 0, which holds the :class:`~weightstream.streaming.delta.Snapshot` its sink
encodes against (the broadcast's sender; in P2P and IPC every sending rank holds its own).

An update is full (every bucket dense, the snapshot made anew) where it is the first, where it was forced (the
last update failed, or its check found a mismatch), where an engine does not take deltas by the transport (it
declares ``delta``; over IPC ``delta`` and ``ipc_ahead``, or ``ipc_delta``: one request per bucket), where the
engines released their weights,
where the bucket plan changed, where an engine holds other bytes than this trainer last committed (restarted,
rolled back, or updated by someone else: its ``delta_base`` differs), and every ``full_every``-th update. Every
delta-mode update, full or not, is checked: each engine rank reports the checksum of each bucket's bytes it
applied, which must equal the trainer's checksum of the bucket's new bytes (in per-rank mode, P2P: the bytes
of the trainer TP rank that sends to it). A delta-mode update by broadcast or P2P into an engine that applies deltas
by IPC only (``ipc_delta`` without ``delta``: its other routes are the engine's own, which take whole buckets) is
refused before anything is paused or sent (:meth:`DeltaTracker.refuse_transport`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from weightstream.engines.base import (
    DELTA,
    IPC_AHEAD,
    IPC_DELTA,
    DeltaChecks,
    DeltaEngine,
    EngineAdapter,
    EngineInfo,
    implementing,
)
from weightstream.streaming.delta import Snapshot

__all__ = ["DELTA_TRANSPORTS", "DELTA_WAYS", "takes_deltas", "transport_problem", "DeltaReport", "DeltaTracker"]


DELTA_TRANSPORTS = ("broadcast", "p2p", "ipc")

# What an engine declares to take deltas by each transport: any one of these sets (by IPC: ahead, each payload
# named on the control channel; or one request per bucket)
DELTA_WAYS: dict[str, tuple[tuple[str, ...], ...]] = {
    "broadcast": ((DELTA,),), "p2p": ((DELTA,),), "ipc": ((DELTA, IPC_AHEAD), (IPC_DELTA,)),
}


def takes_deltas(info: EngineInfo, transport: str) -> bool:
    """Whether an engine of ``info`` takes delta buckets by ``transport``."""
    return any(all(info.can(c) for c in way) for way in DELTA_WAYS.get(transport, ()))


def _ways(transport: str) -> str:
    return " or ".join(" and ".join(map(repr, way)) for way in DELTA_WAYS[transport])


def transport_problem(engines: Sequence[EngineAdapter], transport: str) -> str | None:
    """Why a delta-mode update cannot go by ``transport`` at all (None: it can, full or not): an engine that applies
    deltas by IPC only (``ipc_delta`` without ``delta``) would be sent delta payloads by a broadcast or P2P receiver
    that is the engine's own and takes whole buckets."""
    if transport == "ipc":
        return None
    only = [e.url for e in engines if e.info().can(IPC_DELTA) and not e.info().can(DELTA)]
    if not only:
        return None
    return (f"a delta-mode update by {transport} into engines {only}: they apply deltas by IPC only, one request "
            f"per bucket (they declare 'ipc_delta', not 'delta'), and what they receive by {transport} goes to the "
            f"engine's own receiver, which takes whole buckets; update them by transport='ipc' (colocated), or "
            "without delta")


def _reporter(engine: EngineAdapter) -> DeltaEngine:
    """The engine as the one that reports what it holds and applied (by whichever delta capability it declares)."""
    return implementing(engine, DELTA if engine.info().can(DELTA) else IPC_DELTA, DeltaEngine)


@dataclass
class DeltaReport:
    """What a delta-mode update sent and what its check found."""

    full: bool  # every bucket went dense
    reason: str  # why it was full (or why it could send deltas)
    encoded: bool = False  # the buckets went through the sender's snapshot, and the engines kept their bytes
    encodings: dict[str, int] = field(default_factory=dict)  # buckets per encoding
    changed: int = 0  # words that changed, over the buckets sent as deltas
    words: int = 0  # words of the buckets sent as deltas
    wire_bytes: int = 0  # payload bytes of every bucket
    snapshot_bytes: int = 0  # what the sender keeps to compute deltas
    checked: bool = False  # every engine rank's checksum of every bucket equalled the trainer's
    mismatch: str | None = None  # what the check of a first attempt found (this update then went full)

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.words if self.words else 0.0

    def summary(self) -> str:
        what = "full" if self.full else f"delta ({self.changed_fraction:.2%} of words changed)"
        checked = "checked" if self.checked else "not checked"
        again = f"; after a mismatch: {self.mismatch}" if self.mismatch else ""
        return f"{what}, {self.wire_bytes / 1e6:.2f} MB on the wire, {checked} ({self.reason}){again}"


class DeltaTracker:
    """Which bytes each engine holds, when the next update must be full, and the check of each update."""

    def __init__(self, snapshot: Snapshot, full_every: int | None = None):
        if full_every is not None and full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every}")
        self.snapshot = snapshot
        self.full_every = full_every
        self.expected: dict[str, str] = {}  # per engine: the delta base it holds after our last commit
        self.instances: dict[str, str] = {}  # per engine: the running engine its last check named
        self.plan: str | None = None  # the bucket plan of the bytes in the snapshot
        self.deltas_since_full = 0
        self.forced: str | None = None  # why the next update must be full

    def force_full(self, why: str) -> None:
        """The next update is full; what the engines hold is unknown until then."""
        self.forced = why
        self.snapshot.forget()
        self.expected = {}

    def _full_because(self, engines: Sequence[EngineAdapter], transport: str, plan: str,
                      weights_released: bool) -> str | None:
        if self.forced is not None:
            return self.forced
        if transport not in DELTA_TRANSPORTS:
            return f"deltas travel by broadcast, P2P and IPC ({transport} chosen)"
        unable = [e.url for e in engines if not takes_deltas(e.info(), transport)]
        if unable:
            return f"engines {unable} do not apply deltas by {transport} (they do not declare {_ways(transport)})"
        if not self.snapshot.held:
            return "the first update"
        if weights_released:
            return "the engines released their weights"
        if plan != self.plan:
            return "the bucket plan changed"
        if self.full_every is not None and self.deltas_since_full >= self.full_every - 1:
            return f"every {self.full_every}-th update is full (full_every={self.full_every})"
        for e in engines:
            held = _reporter(e).delta_base()
            if held != self.expected.get(e.url):
                return (f"engine {e.url} holds {held or 'nothing'} to apply deltas to, not what this trainer "
                        f"committed ({self.expected.get(e.url)}): restarted, rolled back or updated elsewhere")
        return None

    def refuse_transport(self, engines: Sequence[EngineAdapter], transport: str) -> None:
        """Rank 0, once the transport is chosen and before anything is paused or sent: raises ``ValueError`` where
        a delta-mode update cannot go by ``transport`` into ``engines`` at all (:func:`transport_problem`)."""
        problem = transport_problem(engines, transport)
        if problem is not None:
            raise ValueError(problem)

    def begin(self, engines: Sequence[EngineAdapter], transport: str, plan: str,
              weights_released: bool = False) -> DeltaReport:
        """Decide this update (full or deltas) and ready the snapshot for it (a transport that cannot carry it is
        refused: :meth:`refuse_transport`)."""
        self.refuse_transport(engines, transport)
        why = self._full_because(engines, transport, plan, weights_released)
        encoded = transport in DELTA_TRANSPORTS and all(takes_deltas(e.info(), transport) for e in engines)
        self.forced = None
        self.snapshot.begin(full=why is not None, active=encoded)
        self.plan = plan
        if not encoded:  # the buckets go as they are: nothing the engines hold is known after this update
            self.force_full(why or "")
            self.forced = None
        return DeltaReport(why is not None, why or f"deltas against version {self._held_version()}", encoded=encoded)

    def _held_version(self) -> str:
        versions = sorted({b.rsplit("/", 1)[-1] for b in self.expected.values()})
        return ", ".join(versions) or "?"

    def sent(self, report: DeltaReport) -> None:
        """What the snapshot encoded, into ``report``."""
        for header in self.snapshot.headers.values():
            report.encodings[header.encoding] = report.encodings.get(header.encoding, 0) + 1
            report.wire_bytes += header.nbytes
            if header.encoding != "dense" or not report.full:
                report.changed += header.count
                report.words += header.words
        report.snapshot_bytes = self.snapshot.nbytes

    def check(self, engines: Sequence[EngineAdapter]) -> list[str]:
        """Every engine rank's checksum of every bucket against the trainer's: each problem, one line."""
        problems = []
        for e in engines:
            checks: DeltaChecks = _reporter(e).delta_checks()
            self.instances[e.url] = checks.instance
            # what engine rank r must report: the one snapshot's (broadcast), or its senders' (per-rank senders)
            ours = self.snapshot.expected.get(e.url) or [self.snapshot.digests] * e.info().tp_size
            missing = sorted({i for rank in ours for i in rank} - set(checks.buckets))
            if missing:
                problems.append(f"engine {e.url} applied no bytes of buckets {missing[:8]}")
            wrong = sorted(i for i, digests in checks.buckets.items()
                           if any(d != rank.get(i) for d, rank in zip(digests, ours, strict=False)))
            if wrong:
                problems.append(f"engine {e.url}: the bytes it applied of buckets {wrong[:8]} differ from the "
                                "trainer's (checksums)")
        return problems

    def committed(self, engines: Sequence[EngineAdapter], version: str, full: bool) -> None:
        """The update is committed: each engine holds ``version``'s bytes."""
        self.expected = {e.url: f"{self.instances.get(e.url)}/{version}" for e in engines}
        self.deltas_since_full = 0 if full else self.deltas_since_full + 1
