"""What a sink is: it delivers buckets, knowing transports, never models."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from weightstream.streaming.bucket import Bucket
from weightstream.streaming.groups import GroupError, destroy_group


@runtime_checkable
class Sink(Protocol):
    """Called on every trainer rank, in this order: ``open``, ``send`` per bucket, ``close``
    (or ``abort`` on failure). A rank that has nothing to deliver treats the calls as no-ops."""

    name: str

    def open(self, stream) -> None: ...

    def send(self, bucket: Bucket) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


def _failures(futures: list[Future], timeout_s: float) -> list[BaseException]:
    out = []
    for f in futures:
        if f.cancelled():
            continue
        try:
            f.result(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001
            out.append(exc)
    return out


def future_errors(futures: list[Future], timeout_s: float) -> list[str]:
    """Wait for every future (bounded); the text of each one that failed."""
    return [str(e) for e in _failures(futures, timeout_s)]


def wait_all(futures: list[Future], timeout_s: float) -> None:
    """Wait for every future (bounded); raise the first failure once all are done."""
    failures = _failures(futures, timeout_s)
    if failures:
        raise failures[0]


class InFlight:
    """One bucket on the wire: its collective and the engines' HTTP replies. Kept until the next
    bucket is ready (so packing overlaps the transfer), then finished: the bucket is only released
    once the transfer has completed and every engine has answered."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._entry: tuple[Bucket, Any, list[Future]] | None = None

    def start(self, bucket: Bucket, work: Any, posts: list[Future]) -> None:
        if self._entry is not None:
            raise RuntimeError("finish() the bucket in flight before starting the next one")
        self._entry = (bucket, work, posts)

    def finish(self) -> None:
        if self._entry is None:
            return
        _, work, posts = self._entry
        self._entry = None
        try:
            work.wait()
        finally:
            wait_all(posts, self.timeout_s)

    def drop(self) -> None:
        self._entry = None


class PipelinedSink:
    """What the broadcast and P2P sinks share: a process group joined together with the engines
    (they are told over HTTP while this side forms it) and left together with them, and a bucket in
    flight while the next is packed."""

    sender: bool
    group: Any = None
    timeout_s: float
    _pool: ThreadPoolExecutor | None = None
    _inflight: InFlight

    def _join(self, posts: list[Future], create: Callable[[], Any]) -> None:
        """Form the group (``create``) while the engines join it (``posts``); on failure, say what
        the engines said too."""
        try:
            group = create()
        except Exception as exc:
            engine_errors = future_errors(posts, self.timeout_s)
            if engine_errors:
                raise GroupError(f"{exc}; the engines said: " + " | ".join(engine_errors)) from exc
            raise
        self.group = group
        wait_all(posts, self.timeout_s)

    def _leave(self, engines: Sequence[Any]) -> None:
        """Destroy the group on ``engines`` and here at the same time (NCCL's teardown waits for its
        peers, so neither side may wait for the other first). Best effort: a dead engine cannot answer."""
        group, self.group = self.group, None
        pool = ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix="ws-destroy")
        posts = [pool.submit(e.destroy_group) for e in engines]
        destroy_group(group)
        future_errors(posts, self.timeout_s)
        pool.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def disconnect(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.sender:
            self._inflight.finish()

    def abort(self) -> None:
        self._inflight.drop()
        self.disconnect()
