"""What a sink is: it delivers buckets, knowing transports, never models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from weightstream.streaming.bucket import Bucket
from weightstream.streaming.stream import BucketStream

__all__ = ["Delivery", "Sink"]


@dataclass(frozen=True)
class Delivery:
    """How a sink delivered its last update."""

    metadata_ahead: bool = False  # every bucket's metadata went to the engines in one request, ahead
    direct: bool = False  # the trainer wrote every tensor straight into the engine's weights (one copy)
    waited_s: float | None = None  # seconds spent waiting for the engines' answers, where the sink counts them
    formed_group: bool = False  # the update formed the group to the engines (it was not kept from before)
    tensors: int | None = None  # HF tensors the engines got, where this rank's stream yields only some (resharding)


@runtime_checkable
class Sink(Protocol):
    """Where buckets go. Every method is called on every trainer rank, in the same order (a sink may run
    collectives of the job in any of them); a rank that has nothing to deliver treats the calls as no-ops. A
    sink lives across updates, made by the first update of its transport and kept by ``WeightSync``:
    ``prepare`` (once, optional), ``connect``; per update ``open``, ``send`` per bucket, ``close`` (or
    ``abort``), ``share_digests``, ``delivery``; at the end ``disconnect``. The engines' sessions (pause,
    begin, commit) are trainer rank 0's, around ``open`` .. ``close``, not the sink's."""

    name: str

    def prepare(self, stream: BucketStream) -> None:
        """``WeightSync.prepare``, before the first update and outside any session (the engines keep serving):
        what the first update would do before its first bytes (an IPC engine learns the plan and maps the
        kept buffers, or exports its weights to write into). Optional: a sink with nothing to do ahead
        returns."""

    def connect(self) -> None:
        """Before an update's ``open`` (``open`` connects where not yet connected): form what carries the
        bytes (a process group with the engines, joined by them at the same time); kept until
        :meth:`disconnect`."""

    def open(self, stream: BucketStream) -> None:
        """Each update, once the engines' sessions are open and before the stream yields its first bucket:
        the transfer of ``stream``'s buckets begins (the metadata of every bucket sent ahead where the
        engines take it). Raises an ``UpdateError`` naming what failed; the update then calls :meth:`abort`."""

    def send(self, bucket: Bucket) -> None:
        """Each bucket, in the stream's order, as it is packed: its bytes go to the engines. It may return
        before they arrived (the next bucket is packed meanwhile); its buffer is not packed again until the
        sink is done with it. A bucket already in the engine's weights (``bucket.written``) sends nothing."""

    def close(self) -> None:
        """After the last bucket: everything in flight has arrived and the engines answered for every
        bucket; then the update may commit (trainer rank 0)."""

    def abort(self) -> None:
        """After a failure on any rank, in place of :meth:`close`: what is in flight is dropped, the engines
        stop waiting, and the connection is torn down within the cleanup budget (the next update connects
        again)."""

    def share_digests(self) -> None:
        """After :meth:`close` of a delta-mode update, on every rank once it went through everywhere: what
        each engine rank must report reaches trainer rank 0 (``Snapshot.expected``; nothing to do where
        rank 0 sent it all), which checks the engines before the commit."""

    def delivery(self) -> Delivery:
        """After :meth:`close`, for the update's report: how the last update went (this rank's view)."""

    def disconnect(self, seconds: float | None = None) -> None:
        """When ``WeightSync`` closes, or its transport changes: leave for good, within ``seconds`` (the
        engines keep their weights and let go of what they held for this trainer)."""
