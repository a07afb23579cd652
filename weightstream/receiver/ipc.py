"""A colocated update on one engine rank (:class:`~weightstream.receiver.plan.IpcReceive`): the trainer rank's
control channel (:mod:`weightstream.wire.channel`), its plan's programs, the buffers it lends (kept mapped across
updates where it asks), the CUDA events both sides' streams wait on instead of either synchronising, and the
writes a trainer may make straight into our weights. Also SGLang's ``/update_weights_from_tensor`` payload
(:class:`~weightstream.receiver.plan.TensorReceive`), whose named shared memory is taken from the same processes."""

from __future__ import annotations

import base64
import gc
import os
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch

from weightstream.receiver.control import answer_error, closing, failures_answered, receive_frame, receive_one
from weightstream.receiver.plan import IpcReceive, TensorReceive
from weightstream.receiver.programs import CopyProgram, WeightExport, export_weights, plan_metas
from weightstream.receiver.schema import unknown_dtypes
from weightstream.receiver.session import UpdateSession
from weightstream.receiver.values import warm_checks
from weightstream.streaming.bucket import Bucket, TensorMeta, typed_buffer
from weightstream.streaming.copies import warm_kernel
from weightstream.streaming.delta import DeltaHeader
from weightstream.wire.channel import Channel
from weightstream.wire.frames import (
    BucketLoaded,
    BucketSent,
    BuffersHeld,
    DeltaRecord,
    Export,
    Finish,
    Hello,
    KeptBuffers,
    LentBuffer,
    Offer,
    OfferAnswer,
    Plan,
    Ready,
    WritesApplied,
    WritesDone,
)
from weightstream.wire.handles import ShmGrant, loads_b64, map_fd

__all__ = ["MAX_PLANS", "IpcReceiver"]

MAX_PLANS = 4  # the IPC plans (their programs) and the exports of our weights a rank keeps, most recent first


class IpcReceiver:
    """One rank's colocated receives, loaded through ``session``; a buffer lent by name (a payload pickled by torch
    on the CPU) is at most ``max_lent_bytes``."""

    def __init__(self, session: UpdateSession, max_lent_bytes: int):
        self.session, self.max_lent_bytes = session, max_lent_bytes
        self.device, self.clock, self.rank = session.at.device, session.at.clock, session.at.rank
        # The last IPC buffers received from a trainer, kept mapped: a trainer that packs into the same few
        # buffers sends the same CUDA IPC handles, which torch resolves from its cache without opening again.
        self.tensor_buffers: deque = deque(maxlen=4)
        # Buffers a trainer sends ahead-style and asks to keep, by its ids; they stay mapped across updates until
        # that trainer says to drop them, another trainer connects, or its lease (the control channel of its last
        # update, which it keeps open) closes: see :meth:`watch`.
        self.client: str | None = None
        self.kept: dict[int, torch.Tensor] = {}
        self.lease: Channel | None = None
        self.engine_pid = os.getppid()  # the engine's own process (the engine sets it: the peer of its pipe)
        self.opened = 0  # buffers opened from a handle (kept or not)
        self.plans: dict[str, list[CopyProgram]] = {}  # bucket programs of the trainers' plans, by their digest
        # Where a colocated trainer may write a plan's tensors itself (one copy): per plan digest, the export
        # (its id; its frame: our weights' storages as handles, each tensor's place in them; the plan's names
        # and our tensors they go into). Made again whenever the weights' storage changes (released, resumed).
        self.exports: dict[str, WeightExport] = {}
        self.direct_updates = 0  # updates the trainer wrote straight into our weights
        self.checked_writes = 0  # of them: checked by the flag the trainer's copies raised (on a GPU)

    def receive(self, r: IpcReceive) -> dict[str, Any]:
        """A colocated receive: an update (:meth:`_receive_ipc`), or, ``prepare``, what comes before a trainer's
        first one (:meth:`_prepare_ipc`)."""
        if r.prepare:
            return self._prepare_ipc(r.plan, r.num_buckets, r.channel, r.client, r.timeout_s)
        if r.begin:  # (ipc_session: this rank's session opens with its receive)
            self.session.begin()
        answer = self._receive_ipc(r.plan, r.num_buckets, r.channel, r.client, r.timeout_s, r.delta, r.finish)
        if r.commit and answer.get("commit") is True:  # (the engine's one rank: its commit is the engine's)
            self.session.commit()
            answer["committed"] = True
        return answer

    # -- the trainer's lease: what it lent stays mapped while its control channel is open ----------------------

    def watched(self) -> int | None:
        """The descriptor of the trainer's lease for the engine to watch between its requests (None: no lease)."""
        return None if self.lease is None else self.lease.fileno()

    def watch(self) -> None:
        """The watched lease is readable: where the trainer's end closed (it exited, however it exited, or
        disconnected), what this rank mapped of it is let go at once."""
        if self.lease is not None and self.lease.ended():
            self._trainer_gone()

    def release(self, client: str) -> dict[str, int]:
        """Close the buffers a trainer ``client`` kept mapped here (it is done with this engine)."""
        held = len(self.kept) if client == self.client else 0
        if client == self.client:
            self._trainer_gone()
        return {"released": held}

    def forget_weight_views(self) -> None:
        """Drop the plans' copies into our weights and the exports of them: their storage is about to go away, or
        has been made anew."""
        self.plans.clear()
        self.exports.clear()

    def _trainer_gone(self) -> None:
        """The trainer's lease ended: close it and the buffers it lent (the engine's own weights it mapped go
        with its process)."""
        if self.lease is not None:
            self.lease.close()
            self.lease = None
        self._close_buffers(None)
        self.client = None

    def _close_buffers(self, ids: list[int] | None) -> None:
        """Drop kept IPC buffers (``None``: all), with the batched copies made out of them, which hold views
        of them: a buffer is closed once nothing refers to it."""
        for i in list(self.kept) if ids is None else ids:
            self.kept.pop(i, None)
        for programs in self.plans.values():
            for program in programs:
                program.copies.clear()

    @contextmanager
    def _leased(self, chan: Channel) -> Iterator[None]:
        """A request on the control channel ``chan``: where it succeeds, the channel becomes the trainer's
        lease (in place of its last one); where it fails, it is closed."""
        try:
            yield
        except BaseException:
            chan.close()
            raise
        lease, self.lease = self.lease, chan
        if lease is not None:
            lease.close()

    def _grant(self) -> ShmGrant:
        """The named shared memory a payload may have this rank map: that made by the engine's own process or by
        the trainer rank at the other end of the lease (the kernel says which process each is), each at most
        ``max_lent_bytes``."""
        pids = {self.engine_pid} | ({self.lease.peer.pid} if self.lease is not None else set())
        return ShmGrant(frozenset(pids), self.max_lent_bytes)

    # -- the update: connect, offer direct writes, take each bucket ------------------------------------------

    def _receive_ipc(self, plan: str, num_buckets: int, channel: str, client: str, timeout_s: float,
                     delta: bool = False, finish: bool = False) -> dict[str, Any]:
        """Every bucket of a colocated update, announced ahead; per bucket the trainer sends one small frame
        on the control ``channel`` naming the buffer (a handle is opened once per kept buffer) and, on a GPU,
        this rank's stream waits for the trainer's event instead of either side synchronising. The reply
        frame goes once the copies are queued; the trainer waits on our event before reusing the buffer.
        The first failure is answered on the channel and raised (nothing after it is loaded). Where every
        tensor of the plan is one whole weight of ours, the trainer may write into our weights instead
        (:meth:`_offer_writes`, :meth:`_take_writes`): no bucket frames then. ``delta``: a delta-mode update,
        every bucket a payload applied to the bytes we hold of it (kept for the next; no writes offered). ``finish``:
        the trainer's last frame (:class:`Finish`) says whether the engine may commit (the answer's ``commit``)."""
        with self.clock("handshake"):
            chan, programs, offer_answer = self._ipc_connect(plan, num_buckets, channel, client, timeout_s)
        with self._leased(chan):
            with self.clock("handshake"):
                offer = self._offer_writes(chan, plan, programs, offer_answer, not delta)
            if offer is not None:
                answer = self._take_writes(chan, *offer, timeout_s * (num_buckets + 1))
            else:
                answer = self._take_buckets(chan, programs, timeout_s, delta)
            if finish:
                with self.clock("wait"):
                    answer["commit"] = receive_one(chan, Finish, timeout_s, "the trainer's last frame").commit
            return answer

    def _ipc_connect(self, plan: str, num_buckets: int, channel: str, client: str,
                     timeout_s: float) -> tuple[Channel, list[CopyProgram], OfferAnswer]:
        """Connect to the trainer rank's control channel, greet it (:class:`Hello`: the buffers we hold of it,
        whether we know ``plan``), read its answer to the offer of direct writes still to come (:class:`OfferAnswer`,
        which it sent as soon as we connected) and take the plan's layout (:class:`Plan`) if we did not know it: the
        channel, each bucket's program and the answer."""
        if client != self.client:  # another trainer: the last one's lease and buffers go, once it has ended
            if self.lease is not None and not self.lease.ended():
                raise RuntimeError(f"engine rank {self.rank} is held over IPC by another trainer (process "
                                   f"{self.lease.peer.pid}, whose control channel is open): that trainer must "
                                   "disconnect first (its WeightSync closed) or exit")
            self._trainer_gone()
            self.client = client
        chan = Channel.connect(channel, timeout_s)
        try:
            programs = self.plans.get(plan)
            chan.send(Hello(self.rank, client, tuple(sorted(self.kept)), programs is not None))
            answer = receive_one(chan, OfferAnswer, timeout_s, "the trainer's answer to the offer of direct writes")
            if programs is None:  # the layout of every bucket, once per plan of this trainer
                made = self._ipc_plan(plan, num_buckets,
                                      receive_one(chan, Plan, timeout_s, "bucket metadata from the trainer"))
                if isinstance(made, str):
                    answer_error(chan, made)
                    raise ValueError(made)
                programs = made
        except BaseException:
            chan.close()
            raise
        return chan, programs, answer

    def _ipc_plan(self, plan: str, num_buckets: int, frame: Plan) -> list[CopyProgram] | str:
        """The programs of every bucket of ``plan`` from the trainer's :class:`Plan` frame (kept for the next
        update of the same plan), or what is wrong with it (the frame's types are checked as it is read)."""
        problems = [f"bucket {i}: unknown dtypes {bad[:5]}" for i, b in enumerate(frame.buckets)
                    if (bad := unknown_dtypes(b.dtypes))]
        if problems:
            return "bad bucket metadata: " + "; ".join(problems)
        if len(frame.buckets) != num_buckets:
            return f"bad bucket metadata: {len(frame.buckets)} buckets described, {num_buckets} announced"
        programs = [self.session.program(plan_metas(b)) for b in frame.buckets]
        self.plans[plan] = programs
        while len(self.plans) > MAX_PLANS:
            self.plans.pop(next(iter(self.plans)))
        gc.freeze()  # kept as long as the plan: see _keep_buffers
        return programs

    def _take_buckets(self, chan: Channel, programs: list[CopyProgram], timeout_s: float,
                      delta: bool = False) -> dict[str, Any]:
        """One :class:`BucketSent` frame per bucket, each loaded and answered (:class:`BucketLoaded`)."""
        loaded = 0
        events = None
        for k, program in enumerate(programs):
            with self.clock("wait"):
                frame, fds = receive_frame(chan, BucketSent, timeout_s, f"the frame of bucket {k} from the trainer", k)
            with self.clock("load"), closing(fds), failures_answered(chan, k):
                if self.device.type == "cuda" and frame.events:
                    events = self._open_events(frame.events)
                loaded += self._load_sent(k, program, frame, fds, events, delta)
            chan.send(BucketLoaded(k))
        if self.device.type == "cuda":
            with self.clock("device finish"):
                torch.cuda.synchronize(self.device)
        return {"loaded": loaded}

    def _load_sent(self, k: int, program: CopyProgram, frame: BucketSent, fds: list[int], events: list | None,
                   delta: bool = False) -> int:
        """Bucket ``k`` out of the buffer ``frame`` names (opened if it comes with the frame); on a GPU (where
        ``events`` are the trainer's) after the trainer's event for it, recording ours once the copies are
        queued. ``delta``: the buffer holds a delta payload (:meth:`_load_delta_sent`)."""
        cuda = self.device.type == "cuda"
        if frame.k != k:
            raise RuntimeError(f"expected bucket {k}, the trainer sent bucket {frame.k}")
        if delta != (frame.delta is not None):
            raise RuntimeError(f"bucket {k} came {'without' if delta else 'with'} a delta header in an update "
                               f"{'' if delta else 'not '}opened as delta-mode")
        if frame.drop:
            self._close_buffers(list(frame.drop))
        whole = self._buffer_of(frame.buffer, frame.keep, fds)
        if frame.delta is None and program.total > frame.nbytes:
            raise RuntimeError(f"bucket {k} needs {program.total} bytes, the trainer sent {frame.nbytes}")
        view = whole.narrow(0, frame.offset, frame.nbytes)
        if cuda and events is None:
            raise RuntimeError("the trainer sent no CUDA events")
        if events is not None:
            torch.cuda.current_stream(self.device).wait_event(events[k % 2])
        if frame.delta is not None:
            loaded = self._load_delta_sent(program, view, frame.delta, frame.checksum)
        else:
            loaded = self.session.load_dense(program, view, frame.checksum, kept=frame.keep)["loaded"]
        if events is not None:
            events[2 + k % 2].record(torch.cuda.current_stream(self.device))
            if not frame.keep:
                # A buffer used once is closed as it is dropped (on return): the copies out of it finish first.
                torch.cuda.current_stream(self.device).synchronize()
        return loaded

    def _load_delta_sent(self, program: CopyProgram, view: torch.Tensor, record: DeltaRecord,
                         expected_checksum: str | None) -> int:
        """A delta-mode bucket out of the trainer's buffer ``view``: its new bytes (:meth:`HeldDeltas.new_bytes`; a
        dense one copied into a buffer of ours first, as those are kept for the next delta), loaded."""
        header, _ = DeltaHeader.from_request(asdict(record), program.total, min(program.total, view.numel()))
        received = view
        if header.encoding == "dense":
            received = typed_buffer(header.nbytes, self.device)
            received.narrow(0, 0, header.nbytes).copy_(view.narrow(0, 0, header.nbytes))
        raw = self.session.deltas.new_bytes(record.index, program.metas, program.total, header, received,
                                            expected_checksum)
        return self.session.load_dense(program, raw, None)["loaded"]

    def _buffer_of(self, named: LentBuffer, keep: bool, fds: list[int]) -> torch.Tensor:
        """The whole buffer a frame names: lent with the frame (kept mapped if ``keep``), or one we hold."""
        if named.lent:
            whole = self._open_lent(named, iter(fds))
            if keep:
                self.kept[named.id] = whole
            return whole
        held = self.kept.get(named.id)
        if held is None:
            raise RuntimeError(f"the trainer named buffer {named.id}, which this engine does not hold")
        return held

    def _open_lent(self, named: LentBuffer, fds: Iterator[int]) -> torch.Tensor:
        """A whole buffer the trainer lends: on the CPU the shared-memory file whose descriptor came with the
        frame (the next of ``fds``; ``fd_bytes``: its size), on a GPU its CUDA IPC handle (``payload``)."""
        if named.fd_bytes is not None:
            fd = next(fds, None)
            if fd is None:
                raise RuntimeError(f"the trainer named buffer {named.id} by a descriptor it did not send")
            whole = map_fd(fd, named.fd_bytes)
        elif named.payload is not None:
            whole = loads_b64(named.payload, self._grant())
        else:
            raise RuntimeError(f"buffer {named.id} is not lent with this frame")
        self.opened += 1
        return whole

    def _open_events(self, handles: Any) -> list:
        """The trainer's interprocess CUDA events, from their handles (base64)."""
        return [torch.cuda.Event.from_ipc_handle(self.device, base64.b64decode(h)) for h in handles]

    # -- before a trainer's first update: its kept buffers mapped, the copies out of them made -----------------

    def _prepare_ipc(self, plan: str, num_buckets: int, channel: str, client: str,
                     timeout_s: float) -> dict[str, int]:
        """Before a trainer's first update: learn its plan's layout, map its kept buffers and make each
        bucket's copies out of the buffer it will arrive in, so that the update itself does none of it. One
        :class:`KeptBuffers` frame, answered with :class:`BuffersHeld`."""
        chan, programs, answer = self._ipc_connect(plan, num_buckets, channel, client, timeout_s)
        warm_checks(self.device)  # the value checks' kernels loaded before the first update, not in it
        with self._leased(chan):
            self._offer_writes(chan, plan, programs, answer)
            frame, fds = receive_frame(chan, KeptBuffers, timeout_s, "the trainer's kept buffers")
            with closing(fds), failures_answered(chan):
                self._keep_buffers(frame, fds, programs)
            chan.send(BuffersHeld(len(self.kept)))
        return {"held": len(self.kept)}

    def _keep_buffers(self, frame: KeptBuffers, fds: list[int], programs: list[CopyProgram]) -> None:
        """Map the buffers ``frame`` lends (its descriptors: ``fds``) and make each bucket's copies out of its
        slot."""
        if frame.drop:
            self._close_buffers(list(frame.drop))
        lent = iter(fds)
        for named in frame.buffers:
            if named.lent:
                self.kept[named.id] = self._open_lent(named, lent)
        slots = [self.kept.get(i) for i in frame.slots]
        for k, program in enumerate(programs):
            whole = slots[k % len(slots)] if slots else None
            if whole is not None and program.runs is not None and program.total <= whole.numel():
                program.copies_from(whole.narrow(0, 0, program.total), kept=True)
        if slots:
            warm_kernel(self.device)  # its first launch compiles it (a second or more): not in the update
        # What was just made lives as long as the plan: left to the cyclic collector, the first update's new
        # objects would set off a collection of all of it (300 ms at 18,867 tensors on a 2-core CPU); frozen,
        # collections skip it (dropped plans are still freed by refcount).
        gc.freeze()

    # -- direct writes: the trainer writes into our weights -----------------------------------------------------

    def _offer_writes(self, chan: Channel, plan: str, programs: list[CopyProgram], answer: OfferAnswer,
                      offer: bool = True) -> tuple[WeightExport, OfferAnswer] | None:
        """Offer the trainer to write the plan's tensors straight into our weights, where every tensor of it is
        one whole weight of ours (loaded by a plain copy): :class:`Offer`. Its ``answer`` (read already: sent before
        the offer) says whether it will where offered, and which export of ours it holds (``have``);
        where it will and we offered, the :class:`Export`
        follows: its id, and unless the trainer holds it, our weights' storages and each tensor's place in
        them. Returns the export and the answer where it will, else None. ``offer`` False: none is made."""
        can = offer and self._can_take_writes(programs)
        chan.send(Offer(can))
        if not (answer.direct and can):  # (the trainer answers before the offer comes: it writes where offered)
            return None
        with failures_answered(chan):
            export = self._export(plan, programs)
            frame, fds = (Export(export.id, None), []) if answer.have == export.id else export.frame()
        chan.send(frame, fds)
        return export, answer

    def _can_take_writes(self, programs: list[CopyProgram]) -> bool:
        """Whether every tensor of the plan is one whole weight of ours (not a shard, nor a vocabulary piece, of
        the dtype it arrives in) and the weights are there."""
        return not (self.session.model.released_bytes or not programs or any(p.runs is None for p in programs))

    def _export(self, plan: str, programs: list[CopyProgram]) -> WeightExport:
        """The export of ``plan``'s weights (:func:`export_weights`), made once per plan and weight storage."""
        made = self.exports.get(plan)
        if made is None:
            made = self.exports[plan] = export_weights(programs, self.device)
            while len(self.exports) > MAX_PLANS:
                self.exports.pop(next(iter(self.exports)))
        return made

    def _take_writes(self, chan: Channel, export: WeightExport, answer: OfferAnswer,
                     bound_s: float) -> dict[str, Any]:
        """The trainer writes every tensor of the plan into our weights (``export``): we back up what it
        overwrites (the session rolls back whole), say :class:`Ready` (on a GPU: an event its stream waits
        on), and wait for its :class:`WritesDone` (on a GPU: our stream waits on its event, then the device
        finishes before we answer :class:`WritesApplied`). What it wrote is checked as a bucket is (a refusal rolls
        the session back): where its copies looked at every value as they wrote it (``WritesDone.checked``), by the
        export's flag they raised, and tensor by tensor only where they raised it; else here, tensor by tensor."""
        cuda = self.device.type == "cuda"
        with failures_answered(chan):
            events = self._open_events(answer.events) if cuda else []
            if cuda and len(events) != 4:
                raise RuntimeError("the trainer sent no CUDA events")
            with self.clock("backup"):
                self.session.model.begin_writes(export.names, export.targets)
            if export.flag is not None:
                export.flag.zero_()  # (on our stream: before the writes, which wait on the event below)
            if cuda:
                events[2].record(torch.cuda.current_stream(self.device))
        chan.send(Ready())
        with self.clock("wait"):  # the trainer writes (on a GPU: queues its writes)
            done = receive_one(chan, WritesDone, bound_s, "the trainer's writes into our weights")
        if cuda:
            with self.clock("device finish"):
                torch.cuda.current_stream(self.device).wait_event(events[0])
                torch.cuda.synchronize(self.device)
        with self.clock("check"), failures_answered(chan):
            flag = export.flag if done.checked else None  # raised by the trainer's checked copies
            self.checked_writes += flag is not None
            if flag is None or int(flag[0]):
                self.session.check_values(list(zip(export.names, export.targets, strict=True)))
        self.direct_updates += 1
        chan.send(WritesApplied(len(export.names)))
        return {"loaded": len(export.names)}

    # -- SGLang's /update_weights_from_tensor ---------------------------------------------------------------

    def receive_tensor(self, r: TensorReceive) -> dict[str, Any]:
        """SGLang's ``/update_weights_from_tensor`` payload, unpickled through the allow-list: named shared
        memory (the CPU) only from the processes :meth:`_grant` knows."""
        with self.clock("load"):
            return self._update_tensor(r.payload, r.load_format, r.expected_checksum)

    def _update_tensor(self, payload: str, load_format: str | None,
                       expected_checksum: str | None) -> dict[str, Any]:
        obj = loads_b64(payload, self._grant())
        if load_format == "flattened_bucket":
            buffer = obj["flattened_tensor"]
            metas = tuple(
                TensorMeta(m.name, m.dtype, tuple(m.shape), int(m.start_idx)) for m in obj["metadata"]
            )
            for meta, m in zip(metas, obj["metadata"], strict=True):
                if meta.offset + meta.nbytes != int(m.end_idx):
                    raise ValueError(f"{meta.name}: metadata end {m.end_idx} != start + size")
                if meta.offset < 0 or int(m.end_idx) > buffer.numel() * buffer.element_size():
                    raise ValueError(f"{meta.name}: bytes {meta.offset} to {m.end_idx} are outside the "
                                     f"{buffer.numel() * buffer.element_size()}-byte buffer")
            if buffer.is_cuda:
                self.tensor_buffers.append(buffer)
            return self.session.apply(Bucket(self.session.bucket_count, buffer, metas), expected_checksum,
                                      foreign=True)
        return self.session.load([(name, t, None) for name, t in obj], foreign=True)
