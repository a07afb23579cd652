"""What the sinks over a process group (broadcast, per-rank P2P, resharding) share: the group formed with the
engines and left with them (:class:`PipelinedSink`), the buckets on the wire while the next is packed
(:class:`Sends`, :class:`InFlight`), and the engines' answers awaited together."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch

from weightstream.common.bounds import Deadline, cleanup_budget
from weightstream.engines.base import DELTA_AHEAD, WARM_GROUP, EngineAdapter, EngineError, EngineUnreachable
from weightstream.errors import UpdateError
from weightstream.sinks.base import Delivery
from weightstream.streaming.bucket import Bucket
from weightstream.streaming.delta import DeltaHeader
from weightstream.streaming.stream import BucketStream
from weightstream.wire.groups import GroupLayout, destroy_group, wait_works, warm_device, warm_group

__all__ = ["future_errors", "refusals", "deltas_ahead", "header_tensor", "Sends", "InFlight", "PipelinedSink"]


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


def refusals(posts: Sequence[Future], engines: Sequence[str]) -> frozenset[str]:
    """Of ``engines`` (each asked by the future at the same place in ``posts``), those whose answer was an error:
    the engine said no. Not one that could not be reached or did not answer in time (what it did is unknown)."""
    def refused(f: Future) -> bool:
        if not f.done() or f.cancelled():
            return False
        exc = f.exception()
        return isinstance(exc, EngineError) and not isinstance(exc, EngineUnreachable)

    return frozenset(url for f, url in zip(posts, engines, strict=False) if refused(f))


def deltas_ahead(engines: Sequence[EngineAdapter]) -> bool:
    """Whether every engine takes a delta-mode update's buckets ahead (:data:`DELTA_AHEAD`: each header on the wire
    before its payload)."""
    return all(e.info().can(DELTA_AHEAD) for e in engines)


def header_tensor(header: DeltaHeader, index: int, device: torch.device) -> torch.Tensor:
    """Bucket ``index``'s delta header as it crosses the wire right before its payload (``DeltaHeader.as_words``,
    int64), on the payload's ``device``: what an engine that took the update's metadata ahead reads to know the
    payload."""
    return torch.tensor(header.as_words(index), dtype=torch.int64, device=device)


class Sends:
    """The collectives that carry one bucket (and the buffers they read, kept alive until they are done).

    On a GPU the trainer need not wait for them on the host to reuse a buffer: :meth:`order` makes the current
    stream (where the next buckets are packed) wait for them on the device, and the host checks them later
    (:meth:`wait`), so the next bucket goes on the wire behind this one with no gap. On a CPU (gloo) the host
    waits for them before a buffer is reused."""

    def __init__(self, works: list[Any], buffers: list[torch.Tensor], backend: str):
        self.works, self.buffers = works, buffers
        # NCCL's collectives run on a stream of the device (gloo's, even of GPU tensors, on the host)
        self.on_device = backend == "nccl" and bool(buffers) and buffers[0].is_cuda
        self.ordered = False

    def order(self) -> None:
        """On a GPU: what is packed from now on into the buffers these read comes after them, in stream order (the
        current stream waits for them on the device; nothing waits on the host)."""
        if self.on_device and not self.ordered:
            for w in self.works:
                w.wait()  # (no timeout: the current stream waits for the collective on the device)
        self.ordered = True

    def wait(self, timeout: timedelta) -> None:
        """Until every collective has finished, on the host, within ``timeout``."""
        wait_works(self.works, self.on_device, timeout)


class InFlight:
    """The buckets on the wire: each one's collectives and the engines' HTTP replies, kept until they are
    done, so that packing overlaps the transfer. When the next bucket starts (:meth:`advance`), the newest is
    ordered before the buffers are reused (:meth:`Sends.order`) and, on a GPU, the one before it is finished on
    the host: the wire always has the next bucket queued behind the one it carries. A bucket's waits share one
    bound, counted from when it went out; a failure is raised as the failure of that bucket."""

    DEPTH = 2  # buckets kept on the wire at once on a GPU (one on a CPU, where the host waits for each)

    def __init__(self, timeout_s: float, engines: Sequence[str] = ()):
        self.timeout_s = timeout_s
        self.engines = list(engines)
        self._entries: list[tuple[Bucket, Sends, list[Future], Deadline]] = []

    def start(self, bucket: Bucket, sends: Sends, posts: list[Future]) -> None:
        if len(self._entries) >= self.DEPTH or (self._entries and not self._entries[-1][1].ordered):
            raise RuntimeError("advance() before starting the next bucket")
        self._entries.append((bucket, sends, posts, Deadline(self.timeout_s)))

    def advance(self) -> None:
        """Before the next bucket is packed and sent: on a GPU the newest is ordered before its buffers are reused
        and the one before it finished; on a CPU every one is finished."""
        if not self._entries:
            return
        newest = self._entries[-1][1]
        if not newest.on_device:
            self._retire(len(self._entries))
            return
        newest.order()
        self._retire(len(self._entries) - (self.DEPTH - 1))

    def finish(self) -> None:
        """Every bucket on the wire finished (each within its bound)."""
        self._retire(len(self._entries))

    def _retire(self, count: int) -> None:
        """The ``count`` oldest buckets finished, in order; the first failure raised (the rest dropped)."""
        while count > 0 and self._entries:
            bucket, sends, posts, deadline = self._entries.pop(0)
            count -= 1
            problems = []
            try:
                sends.wait(deadline.timedelta())
            except Exception as exc:  # noqa: BLE001 — reported with what the engines said
                problems.append(f"transfer: {exc}")
            problems += future_errors(posts, deadline)
            if problems:
                self._entries = []
                raise UpdateError(f"bucket {bucket.index}", " | ".join(problems), self.engines)

    def drop(self) -> None:
        self._entries = []


class PipelinedSink:
    """What the broadcast and P2P sinks share: a process group joined together with the engines
    (they are told over HTTP while this side forms it) and left together with them, and a bucket in
    flight while the next is packed."""

    sender: bool
    group: Any = None
    timeout_s: float
    backend: str
    _pool: ThreadPoolExecutor | None = None
    _inflight: InFlight
    formed: int = 0  # groups this sink has formed
    # The engines that refused to join the group this sink last tried to form: they joined nothing of it, so they
    # are not asked to leave it (a group of that name they hold is another trainer's, left untouched).
    _refused: frozenset[str] = frozenset()
    _formed_before: int = 0  # of them, before the update that is open

    def _begin_update(self) -> None:
        """An update opens: what it forms from now on is its own (:meth:`delivery`)."""
        self._formed_before = self.formed

    def _join(self, posts: list[Future], create: Callable[[], Any], engines: Sequence[str]) -> None:
        """Form the group (``create``, bounded by ``timeout_s`` itself) while the engines join it
        (``posts``, started at the same moment, so they share the bound); on failure, say what the
        engines said too."""
        deadline = Deadline(self.timeout_s + 2.0)  # the engines answer just after their own bound
        self._refused = frozenset()
        try:
            group = create()
        except Exception as exc:  # re-raised with the engines' side
            engine_errors = future_errors(posts, deadline)
            self._refused = refusals(posts, engines)
            said = ("; the engines said: " + " | ".join(engine_errors)) if engine_errors else ""
            raise UpdateError("group", f"{exc}{said}", engines) from exc
        self.group = group
        self.formed += 1
        problems = future_errors(posts, deadline)
        if problems:
            self._refused = refusals(posts, engines)
            raise UpdateError("group", " | ".join(problems), engines)

    @staticmethod
    def _warming(engines: Sequence[EngineAdapter], how: str) -> str:
        """``how`` the group's first transfer goes where every one of ``engines`` declares :data:`WARM_GROUP` (they
        are told it in their :class:`GroupSpec`), else "" (none: an engine that does not expect it would take it
        for a bucket)."""
        return how if all(e.info().can(WARM_GROUP) for e in engines) else ""

    def _form(self, create: Callable[[], Any], how: str, senders: int = 1) -> Any:
        """``create`` the group, then run its first, tiny transfer (:func:`warm_group`) with the engines, ``how``
        :meth:`_warming` says."""
        group = create()
        if how:
            try:
                warm_group(group, how, senders, warm_device(self.backend), self.timeout_s)
            except BaseException:
                destroy_group(group)
                raise
        return group

    _ahead: list[Future] = []  # the engines' replies to the metadata of every bucket, sent ahead
    _ahead_bound: float = 0.0

    def _post_ahead(self, calls: Sequence[Callable[[float], Any]], buckets: int) -> None:
        """Tell each engine (``calls``, each given the bound of its answer) what every one of the ``buckets`` holds,
        before the first goes out; each answers once it has loaded the last: bounded by the whole update."""
        self._ahead_bound = self.timeout_s * (1 + buckets / 8)
        self._ahead = [self._engine_pool().submit(call, self._ahead_bound) for call in calls]

    def _finish_ahead(self, every: bool = True) -> None:
        """Finish the buckets in flight (``every``; else :meth:`InFlight.advance`, before the next bucket); a
        transfer that failed while the engines had the metadata ahead is reported with what the engines
        answered, where they already did (a dead engine says so)."""
        try:
            if every:
                self._inflight.finish()
            else:
                self._inflight.advance()
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
        engines = [e for e in engines if e.url not in self._refused]  # a group of that name there is another's
        self._refused = frozenset()
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
