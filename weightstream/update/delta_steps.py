"""What a delta-mode update does besides a full one: before the sink opens, rank 0 decides full or deltas and every
rank readies its snapshot; before the commit, rank 0 checks the engines' checksums of what they applied."""

from __future__ import annotations

import time

from weightstream.sinks.delta import DeltaTracker
from weightstream.streaming.stream import BucketStream
from weightstream.update.engine_sessions import EngineSessions
from weightstream.update.ranks import as_update_error, rank, share
from weightstream.update.report import UpdateReport
from weightstream.update.transport import Decision

__all__ = ["DeltaSteps"]


class DeltaSteps:
    """The delta steps of every update of one :class:`~weightstream.update.WeightSync` (``tracker``: what the
    engines hold and when an update is full, :mod:`weightstream.sinks.delta`)."""

    def __init__(self, tracker: DeltaTracker, sessions: EngineSessions):
        self.tracker = tracker
        self.sessions = sessions

    def begin(self, decision: Decision, stream: BucketStream, report: UpdateReport) -> BaseException | None:
        """Rank 0 decides full or deltas for this update, and every rank readies its snapshot for it (in per-rank
        mode every TP rank encodes its own buckets). The error every rank returns, if any."""
        decided: tuple[bool, bool] | BaseException | None = None
        if rank() == 0:
            try:
                report.delta = self.tracker.begin(self.sessions.engines, decision.transport, stream.metadata_digest(),
                                                  weights_released="weights" in self.sessions.released)
                decided = (self.tracker.snapshot.full, self.tracker.snapshot.active)
            except Exception as exc:  # noqa: BLE001 — the stream still runs on every rank, then this is raised
                decided = as_update_error("delta", exc, self.sessions.urls())
        decided = share(decided)
        if isinstance(decided, BaseException):
            return decided
        if rank() != 0 and isinstance(decided, tuple):
            self.tracker.snapshot.begin(*decided)
        return None

    def check(self, report: UpdateReport, seconds: dict[str, float]) -> tuple[BaseException | None, str | None]:
        """Rank 0, before the commit: the engines' checksums of what they applied against the trainer's. A
        mismatch aborts the sessions (the engines put their weights back) and forces the next update full;
        returned, said in one line."""
        if report.delta is None or not report.delta.encoded:
            return None, None
        t = time.perf_counter()
        self.tracker.sent(report.delta)
        try:
            problems = self.tracker.check(self.sessions.engines)
        except Exception as exc:  # noqa: BLE001 — shared with every rank
            return as_update_error("delta check", exc, self.sessions.urls()), None
        seconds["check"] = time.perf_counter() - t
        if not problems:
            report.delta.checked = True
            return None, None
        mismatch = "; ".join(problems)
        self.tracker.force_full(f"the check of the last attempt found: {mismatch}")
        # An engine that cannot roll back holds the mismatched bytes: it stays paused until the full update.
        self.sessions.abort(resume_stale=False)
        return None, mismatch
