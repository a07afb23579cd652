"""``IPCSink``: colocated delivery. Trainer rank r and engine TP rank r share a device; each bucket's
flat buffer crosses as a CUDA IPC handle (by GPU UUID) or, on the CPU, as a shared-memory file.

Two ways, by what the engine declares:

- ahead (``ipc_ahead``): the metadata of every bucket goes in one request when the update opens; the engine
  rank connects to a control channel of its trainer rank, and per bucket one frame of a few dozen bytes
  crosses. A buffer the stream keeps (``reuse_buffers``) is sent once and then named by an id (on a GPU as
  a CUDA IPC handle; on the CPU as the descriptor of its unnamed shared-memory file, passed on the channel);
  on a GPU the engine's stream waits on the trainer's event for the bucket, and the trainer's stream waits
  on the engine's event before it packs that buffer again: neither side synchronises its device per bucket,
  and the trainer packs bucket k + 1 while the engine loads bucket k.
- straight into the engine's weights (``direct``, ahead only): where every tensor of the plan is one whole
  weight of the engine (the reference engine at TP 1), the engine offers them on the control channel; the
  trainer maps their storages once per export and its stream writes each tensor into them, one copy and no
  bucket buffer. The engine backs up what is overwritten first and says ready (a CUDA event the trainer's
  stream waits on); at the end the engine's stream waits on the trainer's event.
- per bucket (any other engine, e.g. SGLang's ``/update_weights_from_tensor``): every rank's handle is
  gathered on trainer rank 0, which posts them; every rank holds its buffer until the engine answered. On
  the CPU these handles name shared memory, which an engine that keeps control channels maps only from
  the processes at the other end of one: each colocated rank opens one first (:meth:`IPCSink._announce`).
  A delta-mode update goes so into an engine that declares ``ipc_delta`` (SGLang with weightstream's loader):
  each rank encodes its bucket against its snapshot and the engine's ``encode_ipc`` is given the payload, the
  bucket's ``delta`` header set.

Which of these an update takes, who announces and what is kept between updates is decided once, when it
opens: an :class:`~weightstream.sinks.ipc_plan.IPCPlan` (:func:`~weightstream.sinks.ipc_plan.plan_ipc`), which
the methods below read.

The last control channel of an update stays open until the next update replaces it, or this sink
disconnects: it is this trainer rank's lease on what the engine keeps mapped of it (the kept buffers; this
trainer's mapping of the engine's weights is its own). When it closes, however this process ends, the
engine lets go of them at once.
"""

from __future__ import annotations

import base64
import logging
import os
import time
import uuid
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import torch
import torch.distributed as dist

from weightstream.engines.base import (
    DELTA,
    IPC,
    IPC_AHEAD,
    IPC_DELTA,
    EngineAdapter,
    IPCAheadEngine,
    IPCEngine,
    IpcSession,
    PendingAnswer,
    capable,
    implementing,
)
from weightstream.errors import UpdateError
from weightstream.models.spec import dtype_from_name
from weightstream.sinks.base import Delivery
from weightstream.sinks.ipc_plan import EngineOffer, IPCOptions, IPCPlan, Purpose, Route, StreamShape, plan_ipc
from weightstream.streaming.bucket import Bucket
from weightstream.streaming.delta import Snapshot
from weightstream.wire.channel import Channel, ChannelError, Listener
from weightstream.wire.frames import (
    BucketLoaded,
    BucketSent,
    BuffersHeld,
    DeltaRecord,
    Error,
    Export,
    ExportedWeights,
    Finish,
    Frame,
    FrameError,
    Hello,
    KeptBuffers,
    LentBuffer,
    Offer,
    OfferAnswer,
    Ready,
    WritesApplied,
    WritesDone,
    expect,
)
from weightstream.wire.handles import (
    checksum,
    dumps_b64,
    loads_b64,
    map_fd,
    share_fd,
)

if TYPE_CHECKING:
    from weightstream.streaming.stream import BucketStream

__all__ = ["log", "KEPT_HANDLES", "F", "IPCSink"]


log = logging.getLogger("weightstream")

KEPT_HANDLES = 4  # kept buffers whose handles the engine holds for this trainer (the stream keeps two)
F = TypeVar("F", bound=Frame)


class IPCSink:
    name = "ipc"

    def __init__(self, engine: EngineAdapter, *, checksums: bool = False, timeout_s: float = 60.0,
                 ahead: bool = True, direct: bool = True, delta: Snapshot | None = None):
        """``delta``: this rank's snapshot of the bytes its engine rank holds; in a delta update (the snapshot
        active) each bucket goes through a buffer as the snapshot encodes it (no direct writes: the engine
        keeps every bucket's bytes to apply the next delta to), ahead (the engine declares ``delta`` and
        ``ipc_ahead``) or one request per bucket (it declares ``ipc_delta``)."""
        self.engine = implementing(engine, IPC, IPCEngine)
        self.delta = delta
        self.options = IPCOptions(ahead=ahead, direct=direct, checksums=checksums)
        self.timeout_s = timeout_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.plan = IPCPlan()  # the last update's (or preparation's), decided when it opened (:meth:`_decide`)
        self._client = uuid.uuid4().hex  # names this trainer's buffers to the engine (rank 0's, on every rank)
        self._listener: Listener | None = None
        self._channel: Channel | None = None  # this update's
        self._lease: Channel | None = None  # the last update's, kept open: the engine holds our buffers while it is
        self._ahead: PendingAnswer[Any] | None = None  # rank 0: the engine's request, sent and not yet answered
        self._events: list[torch.cuda.Event] | None = None  # CUDA: ready[0], ready[1], done[0], done[1]
        self._known: OrderedDict[int, tuple[int, torch.Tensor]] = OrderedDict()  # storage -> (id, whole buffer)
        self._next_id = 0
        self._sent = 0
        self._outstanding: deque[tuple[int, Any]] = deque()
        self._device: torch.device | None = None
        self._empty: torch.Tensor | None = None  # what an empty delta payload is lent as (_empty_payload)
        self.waited = 0.0  # seconds of this update spent waiting for the engine's answers
        # Direct writes: the engine's weights mapped here (by HF name) under the engine's export id, and the
        # plans holding copies into them (dropped with them, so the engine can free its memory).
        self._targets: dict[str, torch.Tensor] | None = None
        self._targets_id: str | None = None
        self._flag: torch.Tensor | None = None  # the export's flag (a GPU's), which checked copies raise
        self._checks = False  # this update's copies check what they write (WritesDone.checked)
        self._into_plans: list[weakref.ref] = []
        # IPC_SESSION: the next update's session, opened and committed by its request (fold), whether this rank lets
        # the engine commit it (withhold_commit), and, on rank 0 once it closed, the version the engine then serves.
        self._fold: IpcSession | None = None
        self._lets_commit = True
        self.committed: str | None = None

    # -- per update ------------------------------------------------------------------------------

    def fold(self, session: IpcSession) -> None:
        """The next update's session is opened and committed by its own request (the engine declares
        :data:`~weightstream.engines.base.IPC_SESSION`; call on every rank before :meth:`open`): each rank that sends
        ends with a :class:`Finish` frame, which lets the engine commit unless :meth:`withhold_commit` was called;
        rank 0's :attr:`committed` is then the version the engine serves (None: not committed)."""
        self._fold, self._lets_commit = session, True

    def withhold_commit(self) -> None:
        """This rank does not let the engine commit the update folded in its request (its stream's plan turned out
        stale): the session stays open, for the trainer to abort."""
        self._lets_commit = False

    def open(self, stream: BucketStream) -> None:
        self.committed = None
        plan = self._decide(stream, Purpose.UPDATE)
        if self._fold is not None and not plan.metadata_ahead:
            raise RuntimeError("IPCSink: an update's session folded into its request, but the update does not go "
                               "ahead (the engine's request would not carry it)")
        self._sent = 0
        self.waited = 0.0
        self._outstanding.clear()
        if plan.metadata_ahead:
            self._open_ahead(stream)
        elif plan.announce:
            self._announce(stream)
        if self.plan.writes:  # the engine backs up what we overwrite first: its stream's event, or (CPU) its word
            self._receive(Ready, "connect", "the engine's word that it is ready for the writes")
            if self._events is not None:
                torch.cuda.current_stream(stream.device).wait_event(self._events[2])

    def prepare(self, stream: BucketStream) -> None:
        """Before the first update (``WeightSync.prepare``), on every rank: an engine that takes the metadata
        ahead learns this plan's layout now, and either exports its weights for the stream to write into or
        maps this trainer's two kept buffers, so that the first update sends none of it. The engine keeps
        serving meanwhile."""
        if not self._decide(stream, Purpose.PREPARE).prepares:
            return
        self._open_ahead(stream, prepare=True)
        if self.plan.sends:
            # Written into the engine's weights: no buffers of ours to map (nor to allocate).
            kept = [] if self.plan.route is Route.DIRECT else stream.kept_buffers()
            named = [self._name_buffer(b.untyped_storage(), b.device, keep=True) for b in kept]
            # Bucket k is packed into kept buffer k % 2 from its start: the engine makes its copies out of it now.
            frame = KeptBuffers(buffers=tuple(n.buffer for n in named), slots=tuple(n.buffer.id for n in named),
                                drop=tuple(d for n in named for d in n.drop))
            self._control().send(frame, [fd for n in named for fd in n.fds])
            self._receive(BuffersHeld, "prepare", "the engine's answer to the kept buffers")
        self._finish("prepare")

    def _announce(self, stream) -> None:
        """Per bucket on the CPU, to an engine that takes the control channel: before the first payload, this
        rank opens one (the engine's preparation, with no buffers and no writes), which tells the engine, by
        the kernel's word, which process made the shared memory the payloads name; kept as the lease."""
        self._open_ahead(stream, prepare=True)
        if self.plan.sends:
            self._control().send(KeptBuffers(buffers=(), slots=(), drop=()))
            self._receive(BuffersHeld, "connect", "the engine's answer to this trainer's announcement")
        self._end_ahead("connect")

    def _decide(self, stream: BucketStream, purpose: Purpose) -> IPCPlan:
        """This update's plan (:func:`plan_ipc`): rank 0 asks the engine (its TP size; whether it takes the
        metadata ahead; whether it takes deltas ahead, ``delta``, or one request per bucket, ``ipc_delta``) and
        tells every rank (an :class:`EngineOffer`), which plans alike."""
        info: list[Any] = [None]
        if self.rank == 0:
            i = self.engine.info()
            channels = capable(self.engine, IPC_AHEAD, IPCAheadEngine) is not None
            info = [(EngineOffer(self.engine.url, i.tp_size, channels, i.can(DELTA), i.can(IPC_DELTA)), self._client)]
        if self.world > 1:
            dist.broadcast_object_list(info, group_src=0)
        offer, self._client = info[0]
        shape = StreamShape(full=stream.mode == "full", buckets=len(stream), on_cpu=stream.device.type == "cpu",
                            writable=stream.can_write_into(),
                            reuses_buffers=stream.reuse_buffers and stream.shared is not None,
                            deltas=self.delta is not None and self.delta.active)
        self.plan = plan_ipc(self.options, offer, shape, rank=self.rank, world=self.world, purpose=purpose,
                             before=self.plan)
        return self.plan

    def _open_ahead(self, stream, prepare: bool = False) -> None:
        """The engine's request (the update, or with ``prepare`` its preparation) goes from rank 0; each
        engine rank connects to its trainer rank's control channel and is told the plan's layout if it does
        not know it."""
        listener: Listener | None = None  # where this rank sends: the engine rank of its TP rank connects to it
        if self.plan.sends:
            if self._listener is None:
                self._listener = Listener()
            listener = self._listener
        everyone = self._gather(listener.address if listener is not None else None)
        if self.rank == 0:  # (sent at once; its answer is read when the update ends: _end_ahead)
            channels = everyone[: self.plan.engine_tp]
            engine = self._ahead_engine()
            if prepare:
                self._ahead = engine.prepare_ipc_ahead(stream.metadata_digest(), len(stream), channels, self._client,
                                                       self.timeout_s)
            else:
                self._ahead = engine.receive_ipc_ahead(stream.metadata_digest(), len(stream), channels, self._client,
                                                       self.timeout_s, self.plan.deltas, self._fold)
        if listener is None:
            return
        channel = self._channel = listener.accept(self.timeout_s, abandon=self._engine_gave_up)
        if stream.device.type == "cuda" and self._events is None:
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(4)]
        self._answer_offer()  # (first: the engine reads it right after its greeting)
        hello = self._receive(Hello, "connect", "greeting from the engine")
        held = set(hello.have) if hello.client == self._client else set()
        for key in [k for k, (i, _) in self._known.items() if i not in held]:
            del self._known[key]  # the engine no longer holds it: sent again when next used
        if not hello.plan_known:  # the layout of every bucket, once per plan
            channel.send(self._ahead_engine().ipc_plan_frame([stream.bucket_metas(i) for i in range(len(stream))]))
        self._take_offer(stream)

    def _answer_offer(self) -> None:
        """Before the engine offers its weights to write into (or even greets): whether this rank writes where
        offered (the stream can write into them: it makes every tensor itself; no checksums asked for, as no
        transport copy is left to check), and the export of the engine's weights it holds. Sent as soon as the
        engine connected, it is read by the engine right after its greeting: no round trip waits on it."""
        would = self.plan.offered(True).route is Route.DIRECT
        events = self._event_handles() if would and self._events is not None else ()
        self._control().send(OfferAnswer(direct=would, have=self._targets_id, events=events))

    def _take_offer(self, stream) -> None:
        """The engine offers its weights to write into where it can take the plan so; where the offer and this
        rank's answer both say so, the engine answers with its export's id, and with the export itself unless that
        is the one held (mapped here then), and the stream writes into it. On the CPU the export's storages come
        as descriptors."""
        offer = self._receive(Offer, "connect", "the engine's offer of direct writes")
        self.plan = self.plan.offered(offer.direct)
        if self.plan.route is not Route.DIRECT:
            return
        export, fds = self._receive_fds(Export, "connect", "the engine's weights to write into")
        try:
            if export.id != self._targets_id:
                if export.weights is None:
                    self._refuse("connect", f"the engine named export {export.id}, which this trainer does not "
                                 "hold, and did not send it")
                sizes = export.weights.sizes
                if sizes is not None and len(sizes) != len(fds):
                    self._refuse("connect", f"the engine's export sizes {len(sizes)} storages and came with "
                                 f"{len(fds)} descriptors")
                self.forget_targets()
                (self._targets, self._flag), self._targets_id = _open_targets(export.weights, fds), export.id
        finally:
            _close_all(fds)  # what was mapped keeps descriptors of its own
        self._checks = self._flag is not None and stream.can_check_writes()
        stream.write_into(self._targets, self._targets_id, flag=self._flag if self._checks else None)
        if all(p() is not stream.shared for p in self._into_plans):
            self._into_plans.append(weakref.ref(stream.shared))

    def _event_handles(self) -> tuple[str, ...]:
        """This sink's interprocess CUDA events as the engine opens them (handles, base64)."""
        return tuple(base64.b64encode(e.ipc_handle()).decode() for e in self._cuda_events())

    def forget_targets(self) -> None:
        """Let go of the engine's weights mapped here (and of the copies into them): the engine can free them
        (before it releases its memory, and when this sink is done)."""
        for plan in self._into_plans:
            p = plan()
            if p is not None and self._targets_id is not None:
                p.forget_targets(self._targets_id)
        self._into_plans = []
        self._targets = self._targets_id = self._flag = None

    def _engine_gave_up(self) -> str | None:
        """Why the engine will not connect: its request was answered already, with a refusal (None: not)."""
        refusal = self._refusal(0.0)
        return None if refusal is None else f"the engine refused the update: {refusal}"

    def _refusal(self, wait_s: float) -> Exception | None:
        """What the engine's request raised, where its answer came within ``wait_s`` (None: no answer yet, or one
        that was not a refusal)."""
        if self._ahead is None or not self._ahead.ready(wait_s):
            return None
        try:
            self._ahead.result(self.timeout_s)
        except Exception as exc:  # noqa: BLE001 -- what it said
            return exc
        return None

    def send(self, bucket: Bucket) -> None:
        if bucket.written:  # already in the engine's weights
            return
        if not self.plan.metadata_ahead:
            self._send_one_request(bucket)
            return
        if not self.plan.sends:
            return
        k = self._sent
        self._sent += 1
        buffer, record, keep = bucket.buffer, None, bucket.kept
        if self.plan.deltas:
            header, buffer = self._snapshot().encode(bucket.index, bucket.buffer, bucket.word)
            record = DeltaRecord(bucket.index, header.encoding, header.word, header.total, header.count,
                                 header.nbytes)
            keep = keep and header.encoding == "dense"  # else the payload is a tensor of this bucket's own
            if buffer.untyped_storage().nbytes() == 0:  # no word of the bucket changed
                buffer, keep = self._empty_payload(buffer.device), True
        self._device = buffer.device
        named = self._name_buffer(buffer.untyped_storage(), buffer.device, keep=keep)
        digest = checksum(buffer) if self.options.checksums else None
        events: tuple[str, ...] = ()
        if buffer.is_cuda:
            if k == 0:
                events = self._event_handles()
            self._cuda_events()[k % 2].record(torch.cuda.current_stream(buffer.device))
        frame = BucketSent(k=k, buffer=named.buffer, offset=int(buffer.storage_offset()), nbytes=buffer.numel(),
                           keep=keep, drop=named.drop, checksum=digest, events=events, delta=record)
        self._control().send(frame, named.fds)
        self._outstanding.append((k, named.hold))
        while len(self._outstanding) > 1:  # bucket k - 1's buffer is packed again next
            self._settle()

    def _empty_payload(self, device: torch.device) -> torch.Tensor:
        """What an empty payload (the delta of a bucket in which no word changed) is lent as. An empty tensor has
        no storage to share (no descriptor, no CUDA IPC handle), so it goes as the first 0 bytes of a one-byte
        buffer of this sink's, which the engine keeps (lent once, then named by its id)."""
        if self._empty is None or self._empty.device != device:
            self._empty = torch.zeros(1, dtype=torch.uint8, device=device)
        return self._empty.narrow(0, 0, 0)

    def _name_buffer(self, storage, device: torch.device, keep: bool) -> _Named:
        """How a frame names the buffer of ``storage``: the id of a kept buffer the engine holds, or a new id
        and the buffer itself (kept by the engine if ``keep``, with the oldest kept one dropped past
        ``KEPT_HANDLES``): on a GPU its CUDA IPC handle (``payload``), on the CPU the descriptor of its
        shared-memory file (``fd_bytes``: its size; the descriptor goes with the frame). Also what must stay
        alive until the engine answered (a buffer not kept), and the descriptors to send."""
        known = self._known.get(storage._cdata) if keep else None
        if known is not None:
            return _Named(LentBuffer(known[0]))
        whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        buf_id, self._next_id = self._next_id, self._next_id + 1
        if device.type == "cuda":
            lent, fds = LentBuffer(buf_id, payload=dumps_b64(whole)), []
        else:
            fd, size = share_fd(storage)
            lent, fds = LentBuffer(buf_id, fd_bytes=size), [fd]
        if not keep:
            return _Named(lent, hold=whole, fds=fds)  # alive until the engine has loaded it
        self._known[storage._cdata] = (buf_id, whole)
        drop: tuple[int, ...] = ()
        if len(self._known) > KEPT_HANDLES:
            _, (dropped, _) = self._known.popitem(last=False)
            drop = (dropped,)
        return _Named(lent, drop=drop, fds=fds)

    def _settle(self) -> None:
        """The engine's answer to the oldest bucket in flight; on a GPU this stream then waits for the
        engine's copies out of that buffer (an event), not the host."""
        k, _ = self._outstanding[0]
        t = time.perf_counter()
        reply = self._receive(BucketLoaded, f"bucket {k}", f"answer to bucket {k} from the engine")
        if reply.k != k:
            self._refuse(f"bucket {k}", f"the engine answered for bucket {reply.k} where bucket {k}'s answer was due")
        self.waited += time.perf_counter() - t
        if self._events is not None:
            torch.cuda.current_stream(self._device).wait_event(self._events[2 + k % 2])
        self._outstanding.popleft()

    def _finish_writes(self) -> None:
        """Every tensor is written (queued, on a GPU): the engine's stream waits on our event, then its device
        finishes, and it answers."""
        if self._events is not None:
            self._events[0].record(torch.cuda.current_stream(self._device_of_targets()))
        self._control().send(WritesDone(checked=self._checks))
        self._send_finish()  # (read by the engine once it applied the writes: no wait for it)
        t = time.perf_counter()
        self._receive(WritesApplied, "buckets", "the engine's answer to the writes")
        self.waited += time.perf_counter() - t

    # -- the engine's frames ------------------------------------------------------------------------

    def _receive(self, kind: type[F], phase: str, what: str) -> F:
        """:meth:`_receive_fds` of a frame that comes with no descriptors."""
        frame, fds = self._receive_fds(kind, phase, what)
        if fds:
            _close_all(fds)
            self._refuse(phase, f"{what}: {len(fds)} descriptors came with a {kind.kind!r} frame, which takes none")
        return frame

    def _receive_fds(self, kind: type[F], phase: str, what: str) -> tuple[F, list[int]]:
        """The engine's next frame on this update's channel, which must be a ``kind``, with the descriptors
        that came with it (the caller closes them). Anything else raises :class:`UpdateError` of ``phase``:
        the engine's :class:`Error` frame (what it said), a malformed frame or one of another kind (the
        engine is told, with an :class:`Error` frame), no frame within ``timeout_s``, a channel that broke
        (with what the engine's request answered)."""
        channel = self._control()
        try:
            frame, fds = channel.recv_fds(self.timeout_s, what)
        except FrameError as exc:
            self._refuse(phase, f"{what}: {exc}")
        except TimeoutError as exc:
            raise UpdateError(phase, f"{exc}{self._engine_said(0.0)}", [self.engine.url]) from None
        except ConnectionError as exc:  # the engine's request ends at once too: say what it answered
            raise UpdateError(phase, f"{exc}{self._engine_said(2.0)}", [self.engine.url]) from None
        if isinstance(frame, Error):
            _close_all(fds)
            where = f" at bucket {frame.bucket}" if frame.bucket is not None else ""
            raise UpdateError(phase, f"the engine gave the update up{where}: {frame.message}", [self.engine.url])
        try:
            return expect(frame, kind, what), fds
        except FrameError as exc:
            _close_all(fds)
            self._refuse(phase, f"{exc} (the engine sent {frame.kind!r})")

    def _refuse(self, phase: str, problem: str) -> NoReturn:
        """End this update over a frame of the engine's this side cannot take: the engine is told (an
        :class:`Error` frame, where the channel still takes it) and :class:`UpdateError` is raised."""
        if self._channel is not None:
            try:
                self._channel.send(Error(f"the trainer refused a frame: {problem}"[:4000]))
            except ChannelError:
                pass
        raise UpdateError(phase, f"a bad frame from the engine: {problem}", [self.engine.url])

    def _device_of_targets(self) -> torch.device:
        if self._targets is None:
            raise RuntimeError("IPCSink: no weights of the engine are mapped here to write into")
        return next(iter(self._targets.values())).device

    # -- what only some states have, checked ------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        if self.delta is None:
            raise RuntimeError("IPCSink: a delta-mode bucket, but this sink was made without a snapshot")
        return self.delta

    def _control(self) -> Channel:
        """This update's control channel: opened by :meth:`_open_ahead` on a rank that sends, until the update
        ends (then it is the lease)."""
        if self._channel is None:
            raise RuntimeError("IPCSink: no control channel is open on this rank (no update opened ahead)")
        return self._channel

    def _cuda_events(self) -> list[torch.cuda.Event]:
        """The interprocess events of this sink: made by :meth:`_open_ahead` for a stream on a GPU."""
        if self._events is None:
            raise RuntimeError("IPCSink: a bucket on a GPU, but the update was not opened ahead on one")
        return self._events

    def _ahead_engine(self) -> IPCAheadEngine:
        """The engine as one that keeps control channels: reached only where :meth:`_decide` found that it
        declares ipc_ahead (and has ``receive_ipc_ahead``); its info says so, not its type."""
        if not self.plan.keeps_channels:
            raise RuntimeError(f"IPCSink: the engine at {self.engine.url} does not declare ipc_ahead")
        return cast(IPCAheadEngine, self.engine)

    def _gather(self, mine: Any) -> list[Any]:
        """Every rank's ``mine`` in rank order, on rank 0 (which alone uses it); an empty list on the others."""
        if self.world == 1:
            return [mine]
        everyone = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, everyone, group_dst=0)
        return everyone or []

    def _engine_said(self, wait_s: float) -> str:
        """What the engine answered the update's request, if it does within ``wait_s`` (a dead engine says so)."""
        refusal = self._refusal(wait_s)
        return "" if refusal is None else f" | the engine said: {refusal}"

    def close(self) -> None:
        """The update's end: the answers still due, and the engine's answer to the update's request. The channel
        stays open as the lease (:meth:`_keep_lease`)."""
        self._finish("buckets")

    def _finish(self, phase: str) -> None:
        """What :meth:`close` does, for an update or for :meth:`prepare` (an error raised as one of ``phase``)."""
        if not self.plan.metadata_ahead:
            return
        try:
            if not self.plan.writes:
                self._send_finish()  # (after the last bucket's frame: the engine reads it once all are loaded)
            while self._outstanding:
                self._settle()
            if self.plan.writes:
                self._finish_writes()
        except BaseException:
            self._drop_channel()
            raise
        self._end_ahead(phase)

    def _send_finish(self) -> None:
        """A rank that sends, in an update whose session its request folded: its last frame (:class:`Finish`)."""
        if self._fold is not None and self.plan.sends:
            self._control().send(Finish(commit=self._lets_commit))

    def share_digests(self) -> None:
        """A delta-mode update, on every rank once every rank's buckets went through: engine rank r applied the
        bytes of trainer rank r, whose checksums (its snapshot's) go to rank 0's snapshot (``Snapshot.expected``),
        which checks each engine rank against them. The ranks build the same tensors, but a bucket's bytes
        between its tensors (alignment) are each rank's own."""
        if not self.plan.deltas:
            return
        snapshot = self._snapshot()
        everyone = self._gather(snapshot.digests if self.plan.sends else None)
        if self.rank == 0:
            snapshot.expected = {self.engine.url: everyone[: self.plan.engine_tp]}

    def _keep_lease(self) -> None:
        """This update's channel becomes the lease, in place of the last one."""
        lease, self._lease, self._channel = self._lease, self._channel, None
        if lease is not None:
            lease.close()

    def _drop_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _end_ahead(self, phase: str) -> None:
        """The channel is kept as the lease; the engine's answer to the request (an error of it is raised as
        one of ``phase``)."""
        self._keep_lease()
        ahead, self._ahead = self._ahead, None
        folded, self._fold = self._fold, None
        if ahead is not None:
            try:
                served = ahead.result(self.timeout_s * 2 + 2.0)
            except Exception as exc:  # noqa: BLE001
                raise UpdateError(phase, str(exc), [self.engine.url]) from None
            self.committed = served if folded is not None else None

    def connect(self) -> None:
        """Nothing to form ahead: each update opens its control channels (:meth:`open`)."""

    def delivery(self) -> Delivery:
        return Delivery(metadata_ahead=self.plan.metadata_ahead, direct=self.plan.writes, waited_s=self.waited)

    def abort(self) -> None:
        """After a failure: the channel is closed (the engine stops waiting at once) and this sink is done.
        Writes into the engine's weights already queued finish first, so that none lands after the engine
        has put its backup back."""
        if self.plan.writes and self._events is not None and self._targets:
            torch.cuda.current_stream(self._device_of_targets()).synchronize()
        self._outstanding.clear()
        self._fold = None
        self.disconnect()

    def disconnect(self, seconds: float | None = None) -> None:
        """Done with this engine: the channel and the lease close, so the engine closes the buffers it kept
        mapped for this trainer (it is also asked to, by rank 0: an engine that keeps no lease)."""
        for end in (self._channel, self._lease, self._listener):
            if end is not None:
                end.close()
        self._channel = self._lease = self._listener = None
        if self._ahead is not None:  # (an update that failed: its request's answer is not read)
            self._ahead.abandon()
            self._ahead = None
        plan, self.plan = self.plan, self.plan.released()
        self._known.clear()
        self.forget_targets()
        if plan.engine_holds and self.rank == 0:
            try:
                self._ahead_engine().release_ipc_buffers(self._client, timeout_s=min(self.timeout_s, seconds or 10.0))
            except Exception as exc:  # noqa: BLE001 -- best effort: the engine may be gone
                log.warning("the engine at %s could not close this trainer's IPC buffers: %s", self.engine.url, exc)

    # -- one request per bucket (engines without ``ipc_ahead``) -------------------------------------

    def _send_one_request(self, bucket: Bucket) -> None:
        if self.plan.deltas and self.plan.sends:
            bucket = self._delta_bucket(bucket)
        if bucket.buffer.is_cuda:
            # The engine reads the buffer from another process, outside this stream's order.
            torch.cuda.current_stream(bucket.buffer.device).synchronize()
        mine: Any = None
        if self.plan.sends:
            mine = (self.engine.encode_ipc(bucket), checksum(bucket.buffer) if self.options.checksums else None)
        everyone = self._gather(mine)
        status: list[Any] = [None]
        if self.rank == 0:
            try:
                payloads = [p for p, _ in everyone[: self.plan.engine_tp]]
                digests = [d for _, d in everyone[: self.plan.engine_tp]] if self.options.checksums else None
                self.engine.receive_ipc(bucket.index, payloads, digests)
            except Exception as exc:  # noqa: BLE001 — shared with the other ranks below
                status[0] = UpdateError(f"bucket {bucket.index}", str(exc), [self.engine.url])
        if self.world > 1:
            # Every rank holds its buffer until the engine has loaded it.
            dist.broadcast_object_list(status, group_src=0)
        if status[0] is not None:
            raise status[0]


    def _delta_bucket(self, bucket: Bucket) -> Bucket:
        """``bucket`` as this rank's snapshot encodes it: its payload, its ``delta`` header set (the same tensors
        laid out in the decoded bytes). A payload of no bytes (no word changed) is lent as :meth:`_empty_payload`."""
        header, payload = self._snapshot().encode(bucket.index, bucket.buffer, bucket.word)
        if payload.untyped_storage().nbytes() == 0:
            payload = self._empty_payload(payload.device)
        return Bucket(bucket.index, payload, bucket.metas, delta=header)


@dataclass(frozen=True, slots=True)
class _Named:
    """A buffer as a frame names it (:meth:`IPCSink._name_buffer`), the kept buffers the engine may close, what
    must stay alive until the engine answered, and the descriptors that go with the frame."""

    buffer: LentBuffer
    drop: tuple[int, ...] = ()
    hold: Any = None
    fds: list[int] = field(default_factory=list)


def _open_targets(weights: ExportedWeights, fds: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The engine's weights by HF name, mapped into this process from its export: its weights' storages (on
    the CPU ``sizes``, one descriptor each in ``fds``; on a GPU ``payload``, their CUDA IPC handles), and
    per name its place in them (storage, byte offset, elements, dtype); and its flag (an int32), where it has one."""
    if weights.sizes is not None:
        wholes = [map_fd(fd, n) for fd, n in zip(fds, weights.sizes, strict=True)]
    elif weights.payload is not None:
        wholes = loads_b64(weights.payload)
    else:
        raise ValueError("the engine's export names neither the sizes nor the handles of its storages")
    targets = {}
    for name, idx, offset, numel, dtype in zip(weights.names, weights.storages, weights.offsets, weights.numels,
                                               weights.dtypes, strict=True):
        dt = dtype_from_name(dtype)
        targets[name] = wholes[idx].narrow(0, offset, numel * dt.itemsize).view(dt)
    if weights.flag is not None and weights.flag >= len(wholes):
        raise ValueError(f"the engine's export names storage {weights.flag} its flag, of {len(wholes)} exported")
    flag = None if weights.flag is None else wholes[weights.flag].narrow(0, 0, 4).view(torch.int32)
    return targets, flag


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
