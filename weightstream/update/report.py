"""What an update did: its :class:`UpdateReport`, filled from the stream's counters and the sink's delivery."""

from __future__ import annotations

from dataclasses import dataclass, field

from weightstream.sinks.base import Delivery
from weightstream.sinks.delta import DeltaReport
from weightstream.streaming.stream import BucketStream

__all__ = ["UpdateReport", "fill_report"]


@dataclass
class UpdateReport:
    transport: str
    reason: str
    mode: str
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    gathers: int = 0
    weight_version: str | None = None
    engines: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    metadata_ahead: bool = False  # broadcast / IPC: every bucket's metadata went ahead in one request
    direct: bool = False  # IPC: the trainer wrote every tensor straight into the engine's weights (one copy)
    # IPC: the engine's session was opened (generation paused) and committed (resumed) by the update's own request
    # (the engine declares ``ipc_session``): no request before it, none after it
    session_in_request: bool = False
    planned: bool = False  # this update made the stream's plan (False: it used the one kept, e.g. by prepare)
    copies_made: int = 0  # buckets whose batched copies this update made (0: all were kept)
    formed_group: bool = False  # broadcast / P2P: this update formed the group to the engines (not kept)
    delta: DeltaReport | None = None  # WeightSync(delta=True): full or deltas, and why; the check's result
    # Sent again with a new plan, and why: the stream's kept plan, confirmed in full after the first attempt's
    # buckets (WeightSync), was no longer the model's (a parameter replaced or re-pointed); that attempt was aborted
    # uncommitted.
    replanned: str | None = None

    def summary(self) -> str:
        total = self.seconds.get("total", 0.0)
        how = ", written into the engine's weights" if self.direct else ""
        delta = f"; {self.delta.summary()}" if self.delta is not None else ""
        again = f"; sent again with a new plan ({self.replanned})" if self.replanned is not None else ""
        return (f"{self.transport} ({self.reason}{how}): {self.tensors} tensors, {self.bytes / 1e6:.2f} MB in "
                f"{self.buckets} buckets, {total:.3f} s, version {self.weight_version}{delta}{again}")


def fill_report(report: UpdateReport, stream: BucketStream, delivery: Delivery) -> None:
    report.buckets, report.tensors, report.bytes = stream.stats.buckets, stream.stats.tensors, stream.stats.bytes
    report.gathers = stream.stats.gathers
    report.planned, report.copies_made = stream.stats.planned, stream.stats.copy_programs
    report.metadata_ahead, report.direct = delivery.metadata_ahead, delivery.direct
    report.formed_group = delivery.formed_group
    if delivery.tensors is not None:
        report.tensors = delivery.tensors

