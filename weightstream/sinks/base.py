"""What a sink is: it delivers buckets, knowing transports, never models."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch

from weightstream.common.bounds import Deadline, cleanup_budget
from weightstream.errors import UpdateError
from weightstream.streaming.bucket import Bucket
from weightstream.streaming.stream import BucketStream
from weightstream.wire.groups import GroupLayout, destroy_group


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
    """Where buckets go. Called on every trainer rank; a rank that has nothing to deliver treats the calls
    as no-ops. A sink lives across updates:

    - ``prepare(stream)``, once, optional: what the first update would do before its first bytes (an IPC
      engine learns the plan and maps the kept buffers);
    - ``connect()``: form what carries the bytes (a process group with the engines); kept until
      ``disconnect``; ``open`` connects where not yet connected;
    - per update: ``open(stream)``, ``send(bucket)`` per bucket, then ``close()`` — or ``abort()`` after a
      failure (what is in flight is dropped and the connection torn down within the cleanup budget);
    - ``share_digests()``, on every rank after a delta-mode update went through everywhere: what each engine rank
      must report reaches trainer rank 0 (``Snapshot.expected``; nothing to do where rank 0 sent it all);
    - ``delivery()``: how the last update went;
    - ``disconnect(seconds)``: leave for good (the engines keep their weights)."""

    name: str

    def prepare(self, stream: BucketStream) -> None: ...

    def connect(self) -> None: ...

    def open(self, stream: BucketStream) -> None: ...

    def send(self, bucket: Bucket) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...

    def share_digests(self) -> None: ...

    def delivery(self) -> Delivery: ...

    def disconnect(self, seconds: float | None = None) -> None: ...


def _failures(futures: list[Future], deadline: Deadline) -> list[BaseException]:
    out: list[BaseException] = []
    for f in futures:
        if f.cancelled():
            continue
        try:
            f.result(timeout=deadline.remaining())
        except FutureTimeout:
            out.append(TimeoutError(f"no answer within {deadline.seconds:.0f} s"))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)
    return out


def future_errors(futures: list[Future], deadline: Deadline) -> list[str]:
    """Wait for every future (all within one deadline); the text of each one that failed."""
    return [str(e) for e in _failures(futures, deadline)]


class Sends:
    """The sends of one bucket (and the buffers they read, kept alive until then), waited on together within one
    bound."""

    def __init__(self, works: list[Any], buffers: list[torch.Tensor]):
        self.works, self.buffers = works, buffers

    def wait(self, timeout: timedelta) -> None:
        deadline = Deadline(timeout.total_seconds())
        for w in self.works:
            w.wait(deadline.timedelta())


class InFlight:
    """One bucket on the wire: its collective and the engines' HTTP replies. Kept until the next
    bucket is ready (so packing overlaps the transfer), then finished: the bucket is only released
    once the transfer has completed and every engine has answered. Both waits share one bound,
    counted from when the bucket went out; a failure is raised as the failure of that bucket."""

    def __init__(self, timeout_s: float, engines: Sequence[str] = ()):
        self.timeout_s = timeout_s
        self.engines = list(engines)
        self._entry: tuple[Bucket, Any, list[Future], Deadline] | None = None

    def start(self, bucket: Bucket, work: Any, posts: list[Future]) -> None:
        if self._entry is not None:
            raise RuntimeError("finish() the bucket in flight before starting the next one")
        self._entry = (bucket, work, posts, Deadline(self.timeout_s))

    def finish(self) -> None:
        if self._entry is None:
            return
        bucket, work, posts, deadline = self._entry
        self._entry = None
        problems = []
        try:
            work.wait(deadline.timedelta())
        except Exception as exc:  # noqa: BLE001 — reported with what the engines said
            problems.append(f"transfer: {exc}")
        problems += future_errors(posts, deadline)
        if problems:
            raise UpdateError(f"bucket {bucket.index}", " | ".join(problems), self.engines)

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
    formed: int = 0  # groups this sink has formed
    _formed_before: int = 0  # of them, before the update that is open

    def _begin_update(self) -> None:
        """An update opens: what it forms from now on is its own (:meth:`delivery`)."""
        self._formed_before = self.formed

    def _join(self, posts: list[Future], create: Callable[[], Any], engines: Sequence[str]) -> None:
        """Form the group (``create``, bounded by ``timeout_s`` itself) while the engines join it
        (``posts``, started at the same moment, so they share the bound); on failure, say what the
        engines said too."""
        deadline = Deadline(self.timeout_s + 2.0)  # the engines answer just after their own bound
        try:
            group = create()
        except Exception as exc:  # noqa: BLE001 — re-raised with the engines' side
            engine_errors = future_errors(posts, deadline)
            said = ("; the engines said: " + " | ".join(engine_errors)) if engine_errors else ""
            raise UpdateError("group", f"{exc}{said}", engines) from exc
        self.group = group
        self.formed += 1
        problems = future_errors(posts, deadline)
        if problems:
            raise UpdateError("group", " | ".join(problems), engines)

    _ahead: list[Future] = []  # the engines' replies to the metadata of every bucket, sent ahead
    _ahead_bound: float = 0.0

    def _post_ahead(self, calls: Sequence[Callable[[float], Any]], buckets: int) -> None:
        """Tell each engine (``calls``, each given the bound of its answer) what every one of the ``buckets`` holds,
        before the first goes out; each answers once it has loaded the last: bounded by the whole update."""
        self._ahead_bound = self.timeout_s * (1 + buckets / 8)
        self._ahead = [self._engine_pool().submit(call, self._ahead_bound) for call in calls]

    def _finish_ahead(self) -> None:
        """Finish the bucket in flight; a transfer that failed while the engines had the metadata ahead is
        reported with what the engines answered, where they already did (a dead engine says so)."""
        try:
            self._inflight.finish()
        except UpdateError as exc:
            said = [str(f.exception()) for f in self._ahead if f.done() and f.exception() is not None]
            if said:
                raise UpdateError(exc.phase, f"{exc.detail} | the engines said: {' | '.join(said)}",
                                  exc.engines) from None
            raise

    def _close_ahead(self, engines: Sequence[str]) -> None:
        """Every engine's answer to the metadata sent ahead (each bounded), its failures raised as one error."""
        ahead, self._ahead = self._ahead, []
        if ahead:
            problems = future_errors(ahead, Deadline(self._ahead_bound + 2.0))
            if problems:
                raise UpdateError("buckets", " | ".join(problems), engines)

    def _engine_pool(self) -> ThreadPoolExecutor:
        """The threads that talk to the engines: made by ``connect`` (or handed over with the group)."""
        if self._pool is None:
            raise RuntimeError(f"{type(self).__name__} is not connected")
        return self._pool

    def _leave(self, engines: Sequence[Any], seconds: float) -> None:
        """Destroy the group on ``engines`` and here at the same time (NCCL's teardown waits for its
        peers, so neither side may wait for the other first), within ``seconds``. Best effort: a dead
        or stuck engine cannot answer, and gives its side up by its own bound."""
        group, self.group = self.group, None
        deadline = Deadline(seconds)
        pool = ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix="ws-destroy")
        posts = [pool.submit(e.leave_group, timeout_s=seconds) for e in engines]
        destroy_group(group)
        future_errors(posts, deadline)
        pool.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def prepare(self, stream: BucketStream) -> None:
        """Nothing ahead of the first update but the group (:meth:`connect`)."""

    def connect(self) -> None:
        """Form the group with the engines (kept until :meth:`disconnect`)."""
        raise NotImplementedError

    def disconnect(self, seconds: float | None = None) -> None:
        """Leave the group (within ``seconds``, by default the sink's bound)."""
        raise NotImplementedError

    def delivery(self) -> Delivery:
        return Delivery(formed_group=self.formed > self._formed_before)

    def share_digests(self) -> None:
        """Nothing: the sender is trainer rank 0 (a broadcast)."""

    def layout(self) -> GroupLayout | None:
        """The group this sink forms, as this process sees it; None where this rank forms none."""
        raise NotImplementedError

    def hand_over(self, to: PipelinedSink) -> bool:
        """Give this sink's group, and the threads that talk to its engines, to ``to`` where ``to`` would
        form the very same group (the engines keep their side): nothing is torn down and formed again.
        False, giving nothing, where ``to`` needs another group."""
        if self.group is None or to.group is not None or self.layout() != to.layout():
            return False
        to.group, to._pool = self.group, self._pool
        self.group, self._pool = None, None
        return True

    def close(self) -> None:
        if self.sender:
            self._inflight.finish()

    def abort(self) -> None:
        """After a failure: drop the bucket in flight (and the answers awaited to metadata sent ahead) and leave the
        group within the cleanup budget."""
        self._ahead = []
        self._inflight.drop()
        self.disconnect(cleanup_budget(self.timeout_s))
