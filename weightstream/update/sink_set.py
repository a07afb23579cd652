"""The sinks of a :class:`~weightstream.update.WeightSync`: one per transport used, kept across updates (their
groups and channels are made once), made from the option groups."""

from __future__ import annotations

import logging
from typing import TypedDict

from weightstream.engines.base import EngineAdapter
from weightstream.sinks import BroadcastSink, IPCSink, P2PSink
from weightstream.sinks.base import Sink
from weightstream.sinks.pipelined import PipelinedSink
from weightstream.sinks.reshard import ReshardSink
from weightstream.sources.topology import Topology
from weightstream.streaming.delta import Snapshot
from weightstream.update.options import SyncOptions

__all__ = ["SinkSet"]

log = logging.getLogger("weightstream")


class _GroupKeywords(TypedDict):
    """What the broadcast, P2P and resharding sinks take of the options (their constructors take them one by one)."""

    master_address: str
    master_port: int | None
    backend: str | None
    timeout_s: float
    checksums: bool
    delta: Snapshot | None


class SinkSet:
    """The sinks kept, by transport (``"ipc"``, ``"broadcast"``, ``"p2p"``). ``snapshot``: the delta snapshot the
    sinks encode against (None: full updates only)."""

    def __init__(self, snapshot: Snapshot | None):
        self.snapshot = snapshot
        self.kept: dict[str, Sink] = {}

    def get(self, kind: str, engines: list[EngineAdapter], topology: Topology, reshard: bool,
            options: SyncOptions) -> Sink:
        """The sink of transport ``kind``: the one kept, else a new one made from ``options`` (kept). Broadcast
        and P2P join the engines under one group name, so one of them at a time: where the new sink's group would
        be the same (trainer and engine at TP 1), it takes the other's over instead of forming it again."""
        sink = self.kept.get(kind)
        if sink is not None:
            return sink
        other = {"broadcast": "p2p", "p2p": "broadcast"}.get(kind)
        previous = self.kept.pop(other) if other in self.kept else None
        sink = self._new(kind, engines, topology, reshard, options)
        if previous is not None and not (isinstance(previous, PipelinedSink) and isinstance(sink, PipelinedSink)
                                         and previous.hand_over(sink)):
            previous.disconnect()
        self.kept[kind] = sink
        return sink

    def _new(self, kind: str, engines: list[EngineAdapter], topology: Topology, reshard: bool,
             options: SyncOptions) -> Sink:
        reach, transfer, checksums = options.engines, options.transfer, options.safety.checksums
        if kind == "ipc":
            return IPCSink(engines[0], checksums=checksums, timeout_s=reach.timeout_s, ahead=transfer.metadata_ahead,
                           direct=transfer.direct, delta=self.snapshot)
        group = _GroupKeywords(master_address=reach.master_address, master_port=reach.master_port,
                               backend=reach.backend, timeout_s=reach.timeout_s, checksums=checksums,
                               delta=self.snapshot)
        if kind == "p2p" and reshard:
            return ReshardSink(engines[0], topology, **group)
        if kind == "p2p":
            return P2PSink(engines, topology, **group)
        return BroadcastSink(engines, ahead=transfer.metadata_ahead, **group)

    def ipc(self) -> IPCSink | None:
        sink = self.kept.get("ipc")
        return sink if isinstance(sink, IPCSink) else None

    def abort(self) -> None:
        """After a failure: every sink is dropped (its group torn down), so the next update starts clean."""
        sinks, self.kept = list(self.kept.values()), {}
        for sink in sinks:
            try:
                sink.abort()
            except Exception as exc:  # noqa: BLE001 — best effort: the peer may be gone
                log.warning("could not tear down the %s sink: %s", sink.name, exc)

    def close(self) -> None:
        """Every weight-update group torn down (the engines keep their weights)."""
        sinks, self.kept = list(self.kept.values()), {}
        for sink in sinks:
            sink.disconnect()
