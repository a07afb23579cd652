"""What a sink is: it delivers buckets, knowing transports, never models."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from weightstream.streaming.bucket import Bucket


@runtime_checkable
class Sink(Protocol):
    """Called on every trainer rank, in this order: ``open``, ``send`` per bucket, ``close``
    (or ``abort`` on failure). A rank that has nothing to deliver treats the calls as no-ops."""

    name: str

    def open(self, stream) -> None: ...

    def send(self, bucket: Bucket) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...
