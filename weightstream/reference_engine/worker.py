"""One engine TP rank: holds its shard, joins weight-update groups, receives and loads buckets.

The server drives each worker through a pipe, one :class:`~weightstream.reference_engine.protocol.Command` at a
time, and gets back one ``Reply`` per command, carrying its id; workers of one engine also form their own
process group (the engine's TP group) for the forward pass and for completing vocabulary rows.
"""

from __future__ import annotations

import base64
import gc
import os
import signal
import socket
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import timedelta
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import Any

import torch
import torch.distributed as dist

from weightstream.common.phases import PhaseClock
from weightstream.common.processes import die_with_parent
from weightstream.converters.registry import get_converter
from weightstream.models.spec import dtype_from_name
from weightstream.receiver.control import (
    answer_error,
    closing,
    failures_answered,
    receive_frame,
    receive_one,
)
from weightstream.receiver.deltas import HeldDeltas
from weightstream.receiver.model import program_for
from weightstream.receiver.pieces import assemble, engine_layout, piece_problems
from weightstream.receiver.plan import DenseBucket, IpcReceive, RankBucket, Receive, TensorReceive, Transport
from weightstream.receiver.programs import (
    CopyProgram,
    PiecesProgram,
    ProgramCache,
    WeightExport,
    dense_layout,
    export_weights,
    plan_metas,
    verify_checksum,
    wire_meta,
)
from weightstream.receiver.schema import ep_problem, routed_experts, unknown_dtypes
from weightstream.receiver.transfer import Pipeline, ReceiveBuffers, receive_header, receive_payload
from weightstream.receiver.values import DEFAULT_CHECKS, LoadChecks, check_values
from weightstream.reference_engine.protocol import (
    START_ID,
    AbortSession,
    BeginSession,
    Command,
    CommitSession,
    DeltaChecksums,
    DestroyAllGroups,
    DestroyGroup,
    ForgetDelta,
    Generate,
    InitGroup,
    Layout,
    Logits,
    Memory,
    Outcome,
    OutOfTime,
    PrepareSession,
    ReleaseIpc,
    ReleaseMemory,
    Reply,
    ResumeMemory,
    Shutdown,
    UpdatePhases,
    WeightChecksums,
)
from weightstream.streaming.bucket import (
    Bucket,
    TensorMeta,
    extent,
    typed_buffer,
    typed_views,
    view_tensor,
)
from weightstream.streaming.copies import warm_kernel
from weightstream.streaming.delta import HEADER_WORDS, DeltaHeader
from weightstream.wire.channel import Channel, fd_peer
from weightstream.wire.fp8 import block_fp8_of
from weightstream.wire.frames import (
    BucketLoaded,
    BucketSent,
    BuffersHeld,
    DeltaRecord,
    Export,
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
from weightstream.wire.groups import destroy_group, init_custom_process_group, tcp_store, warm_device, warm_group
from weightstream.wire.handles import ShmGrant, checksum, loads_b64, map_fd

__all__ = ["PROGRAM_TENSORS_PER_WEIGHT", "MAX_PLANS", "Worker", "worker_main"]


PROGRAM_TENSORS_PER_WEIGHT = 4  # the bucket programs a worker keeps: at most this many times its model's tensors
MAX_PLANS = 4  # the IPC plans (their programs) and the exports of our weights a worker keeps, most recent first


class Worker:
    def __init__(self, rank: int, size: int, model_dir: str, device: torch.device, dtype: torch.dtype, ep: int = 1):
        """``ep``: the engine's expert parallelism (1, or ``size``: each rank holds its routed experts whole)."""
        from transformers import AutoConfig

        from weightstream.reference_engine.model import ShardedCausalLM

        self.rank, self.size, self.device = rank, size, device
        # Where an update's time goes on this rank (``update_phases``): the open session's, and the last one's.
        self.clock = PhaseClock()
        self.in_session = False
        self.last_phases: dict[str, float] = {}
        self.session_base = 0  # device bytes allocated when the open (or last) session began
        self.config = AutoConfig.from_pretrained(model_dir)
        if (problem := ep_problem(ep, size, routed_experts(self.config.to_dict()))) is not None:
            raise ValueError(problem)
        self.model = ShardedCausalLM(self.config, rank, size, dist.group.WORLD, device, dtype, ep)
        self.groups: dict[str, Any] = {}
        self.group_masters: dict[str, str] = {}  # per group: the trainer's store it was joined at (named in errors)
        self.groups_warmed = 0  # groups whose first transfer ran as they were joined (GroupSpec.warm)
        self.bucket_count = 0
        # The last IPC buffers received from a trainer, kept mapped: a trainer that packs into the same few
        # buffers sends the same CUDA IPC handles, which torch resolves from its cache without opening again.
        self.ipc_buffers: deque = deque(maxlen=4)
        # Buffers a trainer sends ahead-style (``update_ipc_ahead``) and asks to keep, by its ids; they stay
        # mapped across updates until that trainer says to drop them, another trainer connects, or its lease
        # (the control channel of its last update, which it keeps open) closes: see ``next_command``.
        self.ipc_client: str | None = None
        self.ipc_kept: dict[int, torch.Tensor] = {}
        self.ipc_lease: Channel | None = None
        self.engine_pid = os.getppid()  # the engine's own process: see next_command
        self.ipc_opened = 0  # buffers opened from a handle by update_ipc_ahead (kept or not)
        self.ipc_plans: dict[str, list] = {}  # bucket programs of the trainers' plans, by their digest
        # Where a colocated trainer may write a plan's tensors itself (one copy): per plan digest, the export
        # (its id; its frame: our weights' storages as handles, each tensor's place in them; the plan's names
        # and our tensors they go into). Made again whenever the weights' storage changes (released, resumed).
        self.exports: dict[str, WeightExport] = {}
        self.direct_updates = 0  # updates the trainer wrote straight into our weights
        # GPU: broadcast buckets sent ahead are received into two kept buffers, loaded on a stream of their own.
        self.receive_buffers = ReceiveBuffers(device)
        # Buckets loaded before (dense broadcast ones by names, dtypes, shapes; per-rank and resharded ones by their
        # layout): the parameters they load into, checked once, and how to cut the received buffer; an update
        # repeats the same buckets. Only a bucket that loaded is kept, within PROGRAM_TENSORS_PER_WEIGHT times the
        # model's tensors (:class:`ProgramCache`).
        self.programs = ProgramCache(PROGRAM_TENSORS_PER_WEIGHT * len(self.model.params))
        # What the values an update loads are checked for (worker_main sets the engine's), and the weights the open
        # session loaded NaN or an infinity into (reported with each load's result).
        self.checks = DEFAULT_CHECKS
        self.session_nonfinite: set[str] = set()
        self._load_initial(model_dir)
        # A buffer lent by name (a payload pickled by torch on the CPU) is at most twice the model's size.
        self.max_lent_bytes = 2 * size * sum(st.nbytes() for st in self.model._storages())
        # Delta updates: the bytes of each bucket this worker last applied, within the same bound (:class:`HeldDeltas`).
        self.deltas = HeldDeltas(device, self.max_lent_bytes)

    def _load_initial(self, model_dir: str) -> None:
        """The weights the checkpoint holds (a block-FP8 checkpoint's dequantized, by the same load an update
        takes); the model's FP8 layout from its ``quantization_config``."""
        from weightstream.common.hf_files import CheckpointReader

        fp8 = block_fp8_of(self.config.to_dict().get("quantization_config"))
        try:
            reader = CheckpointReader(model_dir)
        except FileNotFoundError:
            self.model.quantized(fp8, (), get_converter(self.config.model_type).quantizes)
            self.model.mark_never_loaded(set())  # weights come later, through an update
            return
        self.model.quantized(fp8, reader.keys())
        with reader:
            report = self.model.load_weights((n, reader.get(n), None) for n in reader.keys())
        if report.problems:
            raise RuntimeError("initial weights do not fit the model: " + "; ".join(report.problems))
        self.model.mark_never_loaded(set(report.loaded))

    # -- commands ----------------------------------------------------------------------------

    def init_group(self, r: InitGroup):
        """Join the group; ``warm``: then run its first, tiny transfer with the trainer (see ``warm_group``)."""
        master_address, master_port, rank_offset, world_size = r.master_address, r.master_port, r.rank_offset, \
            r.world_size
        group_name, backend, timeout_s, warm = r.group_name, r.backend, r.timeout_s, r.warm
        if group_name in self.groups:  # another trainer's (nothing of it is touched)
            raise RuntimeError(f"weight-update group {group_name!r} is already held here, joined with the trainer at "
                               f"{self.group_masters.get(group_name)}: that trainer must leave it first (its "
                               "WeightSync closed), or this one use another group_name")
        group = init_custom_process_group(
            backend, f"tcp://{master_address}:{master_port}", world_size, rank_offset + self.rank, group_name,
            timedelta(seconds=timeout_s),
        )
        if warm:
            try:
                warm_group(group, warm, r.warm_senders, warm_device(backend, self.device), timeout_s)
            except BaseException:
                destroy_group(group)
                raise
        self.groups[group_name] = group
        self.group_masters[group_name] = f"tcp://{master_address}:{master_port}"
        self.groups_warmed += bool(warm)
        return f"rank {rank_offset + self.rank} of {world_size} joined {group_name}{' (warmed)' if warm else ''}"

    def destroy_group(self, group_name):
        destroy_group(self.groups.pop(group_name, None))
        return "destroyed"

    def destroy_all_groups(self):
        for name in list(self.groups):
            destroy_group(self.groups.pop(name))
        return "destroyed"

    def _group(self, name):
        if name not in self.groups:
            raise RuntimeError(f"no weight-update group {name!r} (call init_weights_update_group first)")
        return self.groups[name]

    # -- receives: one pipeline per transport, its plan saying how the buckets come (ahead, deltas) --------------

    def receive(self, r: Receive):
        """One receive over a weight-update group, by its plan's transport."""
        group = self._group(r.group_name)
        if r.plan.transport is Transport.BROADCAST:
            return self._receive_broadcast(group, r)
        if r.plan.transport is Transport.P2P:
            return self._receive_p2p(group, r)
        return self._receive_pieces(group, r)

    def _receive_broadcast(self, group, r: Receive):
        """Broadcast buckets: sent ahead, back to back (:meth:`_receive_buckets`); one per request, a delta's new
        bytes (:meth:`_receive_bucket_delta`), a flattened bucket, or each tensor broadcast alone."""
        if r.plan.ahead:
            if r.load_format != "flattened_bucket":
                raise ValueError(f"load_format {r.load_format!r}: buckets sent ahead are flattened buckets")
            programs = [self._dense_program(b) for b in r.buckets]
            return self._receive_buckets(group, programs, [(p.total, None) for p in programs], r.plan.delta)
        bucket = r.buckets[0]
        if bucket.delta is not None or r.load_format == "flattened_bucket":
            program = self._dense_program(bucket)
            if bucket.delta is not None:
                return self._receive_bucket_delta(group, program.metas, bucket, program)
            with self.clock("receive"):
                raw = typed_buffer(program.total, self.device)
                dist.broadcast(raw.narrow(0, 0, program.total), group=group, group_src=0)
            with self.clock("load"):
                return self._load_dense(program, raw, bucket.checksum)
        tensors = []
        for name, dt, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True):
            t = torch.empty(shape, dtype=dtype_from_name(dt), device=self.device)
            dist.broadcast(t, group=group, group_src=0)
            tensors.append((name, t, None))
        return self._load(tensors)

    def _receive_p2p(self, group, r: Receive):
        """Per-rank buckets, each sent by its trainer rank: ahead, back to back (:meth:`_receive_buckets`); one per
        request, a delta's new bytes or the bucket as it came."""
        if r.plan.ahead:
            programs = [self._p2p_program(tuple(map(wire_meta, b.metas)), b.nbytes) for b in r.buckets]
            return self._receive_buckets(group, programs, [(b.nbytes, b.src) for b in r.buckets], r.plan.delta)
        bucket = r.buckets[0]
        metas = tuple(map(wire_meta, bucket.metas))
        if bucket.delta is not None:
            return self._receive_bucket_delta(group, metas, bucket)
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        with self.clock("receive"):
            dist.recv(buffer, group=group, group_src=bucket.src)
        with self.clock("load"):
            return self._apply(Bucket(self.bucket_count, buffer, metas), bucket.checksum)

    def _receive_bucket_delta(self, group, metas: tuple[TensorMeta, ...], bucket: DenseBucket | RankBucket,
                              program: CopyProgram | None = None):
        """A bucket of a delta update, its header in the request: checked against the bucket before its payload is
        received (:meth:`DeltaHeader.from_request`), the payload applied to the bytes held of it
        (:meth:`HeldDeltas.new_bytes`) and the new bytes loaded (by ``program``, a broadcast bucket's)."""
        assert bucket.delta is not None  # (the caller's branch)
        src = bucket.src if isinstance(bucket, RankBucket) else None
        total = extent(metas)
        header, index = DeltaHeader.from_request(bucket.delta, total, total)
        with self.clock("receive"):
            received = self._receive_delta(group, header, index, src)
        with self.clock("apply delta"):
            raw = self.deltas.new_bytes(index, metas, total, header, received, bucket.checksum)
        with self.clock("load"):
            if program is not None:
                return self._load_dense(program, raw, None)
            return self._apply(Bucket(self.bucket_count, raw.narrow(0, 0, total), metas), None)

    def _receive_buckets(self, group, programs: list[CopyProgram], wire: list[tuple[int, int | None]],
                         delta: bool):
        """``programs``' buckets sent ahead, received back to back (``wire``: each one's bytes, and the group rank that
        sends it, None: broadcast from rank 0). Whole buckets are received while the last is loaded
        (:class:`Pipeline`); in delta mode each bucket's header comes first (:meth:`DeltaHeader.as_words`), then
        its payload, applied to the bytes held of it. After a failure to apply or load, the rest are still received
        but not loaded, and the failure raised at the end; a header that cannot be read leaves the size of what
        follows unknown, and is raised at once (the sender's transfers then fail within their bound)."""
        pipe = None if delta else Pipeline(self.receive_buffers, max((n for n, _ in wire), default=0))
        words = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device) if delta else None
        loaded, failure = 0, None
        for i, program in enumerate(programs):
            with self.clock("receive"):
                header = None if words is None else receive_header(group, words, wire[i][1], program.total,
                                                                         wire[i][0], i)
                raw = (pipe.receive(i, wire[i][0], group, wire[i][1]) if pipe is not None
                       else self._receive_delta(group, header, i, wire[i][1]))  # type: ignore[arg-type]
            if failure is not None:
                continue
            try:
                loaded += self._load_received(i, program, raw, header, pipe)
            except Exception as exc:  # noqa: BLE001 -- the rest is drained, then this is raised
                failure = f"bucket {i}: {exc}"
        if pipe is not None:
            with self.clock("device finish"):
                pipe.finish()
        if failure is not None:
            raise RuntimeError(failure)
        return {"loaded": loaded}

    def _load_received(self, i: int, program: CopyProgram, raw: torch.Tensor, header: DeltaHeader | None,
                       pipe: Pipeline | None) -> int:
        """Bucket ``i`` sent ahead, loaded: a delta's new bytes (``header``), or the bucket out of the pipeline's
        buffer (on a GPU, a kept buffer: its copies made once)."""
        if header is not None:
            with self.clock("apply delta"):
                raw = self.deltas.new_bytes(i, program.metas, program.total, header, raw, None)
            with self.clock("load"):
                return self._load_dense(program, raw, None)["loaded"]
        assert pipe is not None  # whole buckets come through the pipeline
        with self.clock("load"), pipe.loading(i):
            return self._load_dense(program, raw, None, kept=pipe.cuda)["loaded"]

    def _receive_pieces(self, group, r: Receive):
        """Resharded buckets, each this rank's parts from several trainer ranks (:meth:`_receive_parts`): one per
        request, or sent ahead one after the other with no request between (in delta mode each part's header first
        on the wire: :meth:`_delta_parts`). After a failure the rest are still received (the trainer sends them all)
        but not loaded; the failure is raised at the end."""
        if not r.plan.ahead:
            return self._receive_parts(group, r.buckets[0])
        loaded, failure = 0, None
        for i, parts in enumerate(r.buckets):
            if r.plan.delta:
                parts = self._delta_parts(group, i, parts)
            try:
                done = self._receive_parts(group, parts, load=failure is None)
                loaded += int(done["loaded"]) if done else 0
            except Exception as exc:  # noqa: BLE001 -- the rest is drained, then this is raised
                failure = failure or str(exc)
        if failure is not None:
            raise RuntimeError(failure)
        return {"loaded": loaded}

    def _receive_delta(self, group, header: DeltaHeader, index: int, src: int | None = None) -> torch.Tensor:
        """Delta bucket ``index``'s payload (:func:`receive_payload`)."""
        return receive_payload(group, header, src, self.device)

    def delta_checksums(self) -> dict[int, str]:
        """The checksum of each bucket's bytes the open (or last) session applied (:meth:`HeldDeltas.checksums`)."""
        return self.deltas.checksums()

    def forget_delta(self) -> str:
        """Drop the bytes kept for deltas (the weights were loaded otherwise: they no longer match them)."""
        return f"dropped {self.deltas.forget()} buckets"

    def _p2p_program(self, metas: tuple[TensorMeta, ...], nbytes: int) -> CopyProgram:
        """A per-rank bucket's program (kept by its metadata once it has loaded), of ``nbytes`` on the wire."""
        program = self.programs.get(("p2p", metas))
        if program is None:
            program = self._program(list(metas), key=("p2p", metas))
        if program.total > nbytes:
            raise ValueError(f"a per-rank bucket of {nbytes} bytes whose tensors take {program.total}")
        return program

    def _dense_program(self, bucket: DenseBucket) -> CopyProgram:
        """A dense bucket's program: the one kept of an earlier bucket of the same names, dtypes and shapes, else a
        new one (kept once it has loaded: :meth:`_load_dense`)."""
        program = self.programs.get(bucket.key)
        if program is None:
            program = self._program(dense_layout(bucket.names, bucket.dtypes, bucket.shapes), key=bucket.key)
        return program

    def _ipc_plan(self, plan: str, num_buckets: int, frame: Plan) -> list | str:
        """The programs of every bucket of ``plan`` from the trainer's :class:`Plan` frame (kept for the next
        update of the same plan), or what is wrong with it (the frame's types are checked as it is read)."""
        problems = [f"bucket {i}: unknown dtypes {bad[:5]}" for i, b in enumerate(frame.buckets)
                    if (bad := unknown_dtypes(b.dtypes))]
        if problems:
            return "bad bucket metadata: " + "; ".join(problems)
        if len(frame.buckets) != num_buckets:
            return f"bad bucket metadata: {len(frame.buckets)} buckets described, {num_buckets} announced"
        programs = [self._program(plan_metas(b)) for b in frame.buckets]
        self.ipc_plans[plan] = programs
        while len(self.ipc_plans) > MAX_PLANS:
            self.ipc_plans.pop(next(iter(self.ipc_plans)))
        gc.freeze()  # kept as long as the plan: see prepare_ipc_ahead
        return programs

    def _load_dense(self, program, raw, expected_checksum, kept: bool = False):
        """``kept``: ``raw`` is a buffer this worker holds across updates (its addresses stay), so the copies
        out of it are made once, per buffer (:func:`~weightstream.streaming.copies.batched_copy`)."""
        if program.runs is not None and expected_checksum is None:
            self._check_values([(n, v) for (dtype, sizes, payload) in program.runs
                                for (n, _), v in zip(payload, typed_views(raw, dtype, sizes), strict=True)])
            self.bucket_count += 1
            done = self._report(self.model.load_flat(program.names, program.targets,
                                                     program.copies_from(raw, kept)))
        else:
            done = self._apply(Bucket(self.bucket_count, raw.narrow(0, 0, program.total), program.metas),
                               expected_checksum)
        if program.key is not None:  # it loaded: kept for the next bucket of the same layout
            self.programs.put(program.key, program, len(program.metas))
        return done

    def receive_ipc(self, r: IpcReceive):
        """A colocated receive (:class:`IpcReceive`): an update (:meth:`_receive_ipc`), or, ``prepare``, what comes
        before a trainer's first one (:meth:`_prepare_ipc`)."""
        if r.prepare:
            return self._prepare_ipc(r.plan, r.num_buckets, r.channel, r.client, r.timeout_s)
        return self._receive_ipc(r.plan, r.num_buckets, r.channel, r.client, r.timeout_s, r.delta)

    def _receive_ipc(self, plan, num_buckets, channel, client, timeout_s, delta=False):
        """Every bucket of a colocated update, announced ahead; per bucket the trainer sends one small frame
        on the control ``channel`` naming the buffer (a handle is opened once per kept buffer) and, on a GPU,
        this worker's stream waits for the trainer's event instead of either side synchronising. The reply
        frame goes once the copies are queued; the trainer waits on our event before reusing the buffer.
        The first failure is answered on the channel and raised (nothing after it is loaded). Where every
        tensor of the plan is one whole weight of ours, the trainer may write into our weights instead
        (:meth:`_offer_writes`, :meth:`_take_writes`): no bucket frames then. ``delta``: a delta-mode update,
        every bucket a payload applied to the bytes we hold of it (kept for the next; no writes offered)."""
        with self.clock("handshake"):
            chan, programs = self._ipc_connect(plan, num_buckets, channel, client, timeout_s)
        with self._leased(chan):
            with self.clock("handshake"):
                offer = self._offer_writes(chan, plan, programs, timeout_s, not delta)
            if offer is not None:
                return self._take_writes(chan, *offer, timeout_s * (num_buckets + 1))
            return self._take_buckets(chan, programs, timeout_s, delta)

    def _take_buckets(self, chan: Channel, programs: list, timeout_s: float, delta: bool = False) -> dict:
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

    def _load_sent(self, k: int, program, frame: BucketSent, fds: list[int], events: list | None,
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
            self._close_ipc_buffers(list(frame.drop))
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
            loaded = self._load_dense(program, view, frame.checksum, kept=frame.keep)["loaded"]
        if events is not None:
            events[2 + k % 2].record(torch.cuda.current_stream(self.device))
            if not frame.keep:
                # A buffer used once is closed as it is dropped (on return): the copies out of it finish first.
                torch.cuda.current_stream(self.device).synchronize()
        return loaded

    def _load_delta_sent(self, program, view: torch.Tensor, record: DeltaRecord, expected_checksum) -> int:
        """A delta-mode bucket out of the trainer's buffer ``view``: its new bytes (:meth:`_delta_bytes`; a dense
        one copied into a buffer of ours first, as those are kept for the next delta), loaded."""
        header, _ = DeltaHeader.from_request(asdict(record), program.total, min(program.total, view.numel()))
        received = view
        if header.encoding == "dense":
            received = typed_buffer(header.nbytes, self.device)
            received.narrow(0, 0, header.nbytes).copy_(view.narrow(0, 0, header.nbytes))
        raw = self.deltas.new_bytes(record.index, program.metas, program.total, header, received,
                                expected_checksum)
        return self._load_dense(program, raw, None)["loaded"]

    def _buffer_of(self, named: LentBuffer, keep: bool, fds: list[int]) -> torch.Tensor:
        """The whole buffer a frame names: lent with the frame (kept mapped if ``keep``), or one we hold."""
        if named.lent:
            whole = self._open_lent(named, iter(fds))
            if keep:
                self.ipc_kept[named.id] = whole
            return whole
        held = self.ipc_kept.get(named.id)
        if held is None:
            raise RuntimeError(f"the trainer named buffer {named.id}, which this engine does not hold")
        return held

    def _prepare_ipc(self, plan, num_buckets, channel, client, timeout_s):
        """Before a trainer's first update: learn its plan's layout, map its kept buffers and make each
        bucket's copies out of the buffer it will arrive in, so that the update itself does none of it. One
        :class:`KeptBuffers` frame, answered with :class:`BuffersHeld`."""
        chan, programs = self._ipc_connect(plan, num_buckets, channel, client, timeout_s)
        with self._leased(chan):
            self._offer_writes(chan, plan, programs, timeout_s)
            frame, fds = receive_frame(chan, KeptBuffers, timeout_s, "the trainer's kept buffers")
            with closing(fds), failures_answered(chan):
                self._keep_buffers(frame, fds, programs)
            chan.send(BuffersHeld(len(self.ipc_kept)))
        return {"held": len(self.ipc_kept)}

    def _keep_buffers(self, frame: KeptBuffers, fds: list[int], programs: list) -> None:
        """Map the buffers ``frame`` lends (its descriptors: ``fds``) and make each bucket's copies out of its
        slot."""
        if frame.drop:
            self._close_ipc_buffers(list(frame.drop))
        lent = iter(fds)
        for named in frame.buffers:
            if named.lent:
                self.ipc_kept[named.id] = self._open_lent(named, lent)
        slots = [self.ipc_kept.get(i) for i in frame.slots]
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
        self.ipc_opened += 1
        return whole

    def _grant(self) -> ShmGrant:
        """The named shared memory a payload may have this worker map: that made by the engine's own process
        (the other end of the server's pipe) or by the trainer rank at the other end of the lease (the kernel
        says which process each is), each at most ``max_lent_bytes``."""
        pids = {self.engine_pid} | ({self.ipc_lease.peer.pid} if self.ipc_lease is not None else set())
        return ShmGrant(frozenset(pids), self.max_lent_bytes)

    @contextmanager
    def _leased(self, chan: Channel) -> Iterator[None]:
        """A request on the control channel ``chan``: where it succeeds, the channel becomes the trainer's
        lease (in place of its last one); where it fails, it is closed."""
        try:
            yield
        except BaseException:
            chan.close()
            raise
        lease, self.ipc_lease = self.ipc_lease, chan
        if lease is not None:
            lease.close()

    def next_command(self, conn: Connection) -> Command:
        """The server's next command. Meanwhile the trainer's lease is watched: when the trainer's end closes
        (it exited, however it exited, or disconnected), what this worker mapped of it is let go at once."""
        # The pipe is a socket pair the engine's process made: the kernel names that process, whatever started
        # this worker (a fork server, spawn).
        self.engine_pid = fd_peer(conn.fileno()).pid
        while True:
            # The lease by its descriptor: what wait() registers of it anyway, and a type typeshed knows.
            watched: list[Connection | int] = [conn] if self.ipc_lease is None else [conn, self.ipc_lease.fileno()]
            ready = wait_for(watched)
            if conn in ready:
                command = conn.recv()
                if not isinstance(command, Command):
                    raise EOFError(f"the server sent a {type(command).__name__}, not a Command")
                return command
            if self.ipc_lease is not None and self.ipc_lease.ended():
                self._trainer_gone()

    def _trainer_gone(self) -> None:
        """The trainer's lease ended: close it and the buffers it lent (the engine's own weights it mapped go
        with its process)."""
        if self.ipc_lease is not None:
            self.ipc_lease.close()
            self.ipc_lease = None
        self._close_ipc_buffers(None)
        self.ipc_client = None

    def _offer_writes(self, chan, plan, programs, timeout_s, offer: bool = True,
                      ) -> tuple[WeightExport, OfferAnswer] | None:
        """Offer the trainer to write the plan's tensors straight into our weights, where every tensor of it is
        one whole weight of ours (loaded by a plain copy): :class:`Offer`. Its :class:`OfferAnswer` says
        whether it will, and which export of ours it holds (``have``); where it will, the :class:`Export`
        follows: its id, and unless the trainer holds it, our weights' storages and each tensor's place in
        them. Returns the export and the answer where it will, else None. ``offer`` False: none is made."""
        can = offer and self._can_take_writes(programs)
        chan.send(Offer(can))
        answer = receive_one(chan, OfferAnswer, timeout_s, "the trainer's answer to the offer of direct writes")
        if not answer.direct:
            return None
        with failures_answered(chan):
            if not can:
                raise RuntimeError("the trainer asked to write into weights this engine did not offer")
            export = self._export(plan, programs)
            frame, fds = (Export(export.id, None), []) if answer.have == export.id else export.frame()
        chan.send(frame, fds)
        return export, answer

    def _can_take_writes(self, programs) -> bool:
        """Whether every tensor of the plan is one whole weight of ours (not a shard, nor a vocabulary piece, of
        the dtype it arrives in) and the weights are there."""
        return not (self.model.released_bytes or not programs or any(p.runs is None for p in programs))

    def _export(self, plan, programs) -> WeightExport:
        """The export of ``plan``'s weights (:func:`export_weights`), made once per plan and weight storage."""
        made = self.exports.get(plan)
        if made is None:
            made = self.exports[plan] = export_weights(programs, self.device)
            while len(self.exports) > MAX_PLANS:
                self.exports.pop(next(iter(self.exports)))
        return made

    def _take_writes(self, chan: Channel, export: WeightExport, answer: OfferAnswer, bound_s: float) -> dict:
        """The trainer writes every tensor of the plan into our weights (``export``): we back up what it
        overwrites (the session rolls back whole), say :class:`Ready` (on a GPU: an event its stream waits
        on), and wait for its :class:`WritesDone` (on a GPU: our stream waits on its event, then the device
        finishes before we answer :class:`WritesApplied`)."""
        cuda = self.device.type == "cuda"
        with failures_answered(chan):
            events = self._open_events(answer.events) if cuda else []
            if cuda and len(events) != 4:
                raise RuntimeError("the trainer sent no CUDA events")
            with self.clock("backup"):
                self.model.begin_writes(export.names, export.targets)
            if cuda:
                events[2].record(torch.cuda.current_stream(self.device))
        chan.send(Ready())
        with self.clock("wait"):  # the trainer writes (on a GPU: queues its writes)
            receive_one(chan, WritesDone, bound_s, "the trainer's writes into our weights")
        if cuda:
            with self.clock("device finish"):
                torch.cuda.current_stream(self.device).wait_event(events[0])
                torch.cuda.synchronize(self.device)
        with self.clock("check"), failures_answered(chan):  # what it wrote, checked as a bucket is (rolled back)
            self._check_values(list(zip(export.names, export.targets, strict=True)))
        self.direct_updates += 1
        chan.send(WritesApplied(len(export.names)))
        return {"loaded": len(export.names)}

    def _open_events(self, handles) -> list:
        """The trainer's interprocess CUDA events, from their handles (base64)."""
        return [torch.cuda.Event.from_ipc_handle(self.device, base64.b64decode(h)) for h in handles]

    def _ipc_connect(self, plan, num_buckets, channel, client, timeout_s):
        """Connect to the trainer rank's control channel, greet it (:class:`Hello`: the buffers we hold of it,
        whether we know ``plan``) and take the plan's layout (:class:`Plan`) if we did not: the channel and
        each bucket's program."""
        if client != self.ipc_client:  # another trainer: the last one's lease and buffers go, once it has ended
            if self.ipc_lease is not None and not self.ipc_lease.ended():
                raise RuntimeError(f"engine rank {self.rank} is held over IPC by another trainer (process "
                                   f"{self.ipc_lease.peer.pid}, whose control channel is open): that trainer must "
                                   "disconnect first (its WeightSync closed) or exit")
            self._trainer_gone()
            self.ipc_client = client
        chan = Channel.connect(channel, timeout_s)
        try:
            programs = self.ipc_plans.get(plan)
            chan.send(Hello(self.rank, client, tuple(sorted(self.ipc_kept)), programs is not None))
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
        return chan, programs

    def _receive_parts(self, group, parts: tuple[RankBucket, ...], load: bool = True):
        """A resharded per-rank bucket: ``parts`` from several trainer ranks (each ``src``, ``metas``, ``nbytes``,
        ``checksum``), every piece placed in its whole tensor; received together, checked to tile this rank's
        part of each tensor exactly, put together and loaded, or refused whole (nothing loaded), naming every
        problem. ``load`` False: received and dropped (after a failure, so that the sends complete)."""
        buffers = [torch.empty(p.nbytes, dtype=torch.uint8, device=self.device) for p in parts]
        with self.clock("receive"):
            works = [dist.irecv(b, group=group, group_src=p.src) for b, p in zip(buffers, parts, strict=True)]
            for w in works:
                if w is not None:
                    w.wait()
        index = self.bucket_count
        self.bucket_count += 1
        if not load:
            return None
        layouts = [tuple(map(wire_meta, p.metas)) for p in parts]
        if any(p.delta is not None for p in parts):
            with self.clock("apply delta"):
                buffers = self._pieces_from_deltas(parts, layouts, buffers)
        problems: list[str] = []
        pieces: list[tuple[TensorMeta, torch.Tensor]] = []
        for buffer, part, layout in zip(buffers, parts, layouts, strict=True):
            if (part.delta is None and part.checksum is not None
                    and checksum(buffer) != part.checksum):
                problems.append(f"the bytes from trainer rank {part.src} arrived corrupted (checksum)")
            pieces.extend((meta, view_tensor(buffer, meta)) for meta in layout)
        if problems:
            raise ValueError(f"bucket {index} refused, nothing of it loaded: " + "; ".join(problems))
        with self.clock("load"):  # (putting the pieces together included)
            program = self._pieces_program(tuple(layouts))
            if program is not None:  # every piece copied straight into its place in the parameters, in one call
                self._check_values([(m.name, t) for m, t in pieces])
                copy = partial(torch._foreach_copy_, program.dests, [t for _, t in pieces])
                return self._report(self.model.load_flat(program.names, program.targets, [copy]))
            weights, problems = assemble(pieces, self.model.params, self.rank, self.size,
                                         elsewhere=self.model.elsewhere)
            if problems:
                raise ValueError(f"bucket {index} refused, nothing of it loaded: " + "; ".join(problems))
            return self._load(weights)

    def _pieces_program(self, layouts: tuple[tuple[TensorMeta, ...], ...]) -> PiecesProgram | None:
        """A resharded bucket's pieces (``layouts``: per trainer rank's part) loaded by plain copies, where they tile
        this rank's parts and each loads by one (:meth:`ShardedCausalLM.piece_targets`): the tensors' names, their
        parameters (kept as backups) and the view each piece fills; None: they go through ``assemble``. Made once
        per layout (kept with the programs, dropped when the weights move)."""
        key = ("pieces", layouts)
        if key in self.programs:
            return self.programs.get(key)
        metas = [m for layout in layouts for m in layout]
        if piece_problems(metas, self.model.params, self.rank, self.size, elsewhere=self.model.elsewhere):
            return None  # refused by ``assemble``, naming every problem; nothing of it kept
        dests = self.model.piece_targets(metas)
        names = list(dict.fromkeys(m.name for m in metas))
        program = None if dests is None else PiecesProgram(
            tuple(names), ([self.model.params[n][0] for n in names],), tuple(dests))
        self.programs.put(key, program, len(metas))
        return program

    def _delta_parts(self, group, index: int, parts: tuple[RankBucket, ...]) -> tuple[RankBucket, ...]:
        """Resharded bucket ``index``'s parts of a delta-mode update sent ahead: each part's header, read from its
        sender before its payload (:meth:`DeltaHeader.as_words`), into the part as a per-bucket request carries it
        (``delta``, and the payload's ``nbytes``). A header that cannot be is raised at once (what follows it is of
        unknown size; the senders' transfers then fail within their bound)."""
        words = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        out = []
        with self.clock("receive"):
            for part in parts:
                layout = tuple(map(wire_meta, part.metas))
                header = receive_header(group, words, part.src, extent(layout), part.nbytes, index)
                out.append(replace(part, nbytes=header.nbytes, delta={**header.as_json(), "index": index}))
        return tuple(out)

    def _pieces_from_deltas(self, parts: tuple[RankBucket, ...], layouts: list[tuple[TensorMeta, ...]],
                            payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        """A resharded delta-mode bucket: each trainer rank's part (laid out as its ``layouts`` entry), its new
        bytes from its payload, held per bucket and trainer rank (:meth:`_delta_bytes`)."""
        if any(p.delta is None for p in parts):
            raise ValueError("a resharded bucket with deltas from some trainer ranks, not from others")
        deltas = [p.delta for p in parts if p.delta is not None]
        indices = {int(d["index"]) for d in deltas}
        if len(indices) != 1:
            raise ValueError(f"the parts of one resharded bucket name buckets {sorted(indices)}")
        index = indices.pop()
        out = []
        for part, layout, delta, payload in zip(parts, layouts, deltas, payloads, strict=True):
            total = extent(layout)
            header, _ = DeltaHeader.from_request(delta, total, min(total, payload.numel()))
            out.append(self.deltas.new_bytes((index, part.src), layout, total, header, payload,
                                         part.checksum))
        return out

    def layout(self) -> dict[str, dict[str, int | None] | dict[str, int]]:
        """How this rank holds the checkpoint's tensors: ``dims``, the dim each is split on (those held whole
        omitted), and ``owners``, the one rank that holds each tensor held by one rank alone (experts under expert
        parallelism)."""
        declared = engine_layout(self.model.params, self.size, self.model.owners())
        return {"dims": dict(declared.dims), "owners": dict(declared.owners)}

    def weight_checksums(self, names: list[str]) -> dict[str, str]:
        """The checksum (:func:`~weightstream.wire.handles.checksum`) of the bytes this rank holds of each of
        ``names`` it holds (its part of a split tensor); the names it does not hold are left out."""
        held = {n: self.model.params[n][0] for n in names if n in self.model.params}
        return {n: checksum(t.contiguous().reshape(-1).view(torch.uint8)) for n, t in held.items()}

    def receive_tensor(self, r: TensorReceive):
        """SGLang's ``/update_weights_from_tensor`` payload, unpickled through the allow-list: named shared
        memory (the CPU) only from the processes :meth:`_grant` knows."""
        with self.clock("load"):
            return self._update_tensor(r.payload, r.load_format, r.expected_checksum)

    def _update_tensor(self, payload, load_format, expected_checksum):
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
                self.ipc_buffers.append(buffer)
            return self._apply(Bucket(self.bucket_count, buffer, metas), expected_checksum, foreign=True)
        return self._load([(name, t, None) for name, t in obj], foreign=True)

    def _apply(self, bucket: Bucket, expected_checksum, foreign: bool = False):
        index = self.bucket_count
        self.bucket_count += 1
        verify_checksum(bucket.buffer, expected_checksum, f"bucket {index}",
                        lambda: f"; its tensors: {[m.name for m in bucket.metas]}")
        return self._load([(m.name, view_tensor(bucket.buffer, m), m.shard) for m in bucket.metas], foreign)

    def _program(self, metas: list[TensorMeta], key: tuple | None = None) -> CopyProgram:
        """The copy program of a bucket of ``metas`` into this model (:func:`program_for`); ``key``: where it is
        kept in :attr:`programs` once a bucket has loaded by it."""
        return program_for(self.model, metas, key)

    def _report(self, report):
        if report.problems:
            raise RuntimeError(f"{len(report.problems)} tensors could not be loaded: " + "; ".join(report.problems))
        done: dict[str, Any] = {"loaded": len(report.loaded)}  # a count: the names would cross the pipe per update
        if self.session_nonfinite:
            done["nonfinite"] = sorted(self.session_nonfinite)
        return done

    def _check_values(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Refuse a bucket (``named``: its tensors as they arrived) whose values :attr:`checks` refuse, every problem
        named (:mod:`~weightstream.receiver.values`); log the weights it holds NaN or an infinity in, which
        the session reports."""
        report = check_values(named)
        refusal = report.refusal(self.checks)
        if refusal is not None:
            raise ValueError(refusal)
        if report.nonfinite:
            self.session_nonfinite.update(report.nonfinite)
            print(f"weightstream engine: rank {self.rank}: an update loads NaN or an infinity into "
                  f"{len(report.nonfinite)} tensors: {', '.join(report.nonfinite[:8])}"
                  f"{' ...' if len(report.nonfinite) > 8 else ''} (served as they are; --refuse-nonfinite refuses "
                  "them)", file=sys.stderr, flush=True)

    def _load(self, tensors, foreign: bool = False):
        """``foreign``: the tensors live in the sender's memory (IPC), which it may free or reuse as soon as
        we answer, so the copies are finished first. A buffer of our own (broadcast, P2P) is freed into
        this stream's allocator, which orders its reuse after the copies: the answer goes at once and
        the next bucket's receive overlaps this one's copies."""
        tensors = list(tensors)
        self._check_values([(name, t) for name, t, _ in tensors])
        report = self.model.load_weights(tensors)
        if foreign and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._report(report)

    def begin_session(self):
        place = self.model.begin_session()
        if place.where != "device" and self.model.rollback:
            print(f"weightstream engine rank {self.rank}: rollback copies {place.where}: {place.why}", file=sys.stderr,
                  flush=True)
        if self.device.type == "cuda":  # the session's peak beyond what the engine held before it
            torch.cuda.reset_peak_memory_stats(self.device)
            self.session_base = torch.cuda.memory_allocated(self.device)
        self.bucket_count = 0
        self.deltas.begin()
        self.session_nonfinite = set()
        self.clock.reset()
        self.in_session = True
        return "ok"

    def prepare_session(self):
        """The first phase of a commit across engines: what could still fail is done (the model's
        :meth:`prepare_session`; on a GPU the device finishes, so an error of its queued work shows now), and
        the session stays open, restorable, until committed or aborted."""
        with self.clock("commit"):
            self.model.prepare_session()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return "ok"

    def commit_session(self):
        with self.clock("commit"):
            self.model.commit_session()
        self.bucket_count = 0
        self._end_session()
        return "ok"

    def _end_session(self) -> None:
        self.in_session = False
        self.last_phases = self.clock.reset()

    def update_phases(self) -> dict[str, float]:
        """Seconds per phase of the last update session on this rank (host time; see :class:`PhaseClock`):
        ``handshake`` (IPC: the channel, the plan, the offer), ``wait`` (IPC: for the trainer's next frame or its
        writes), ``receive`` (a collective's receive; on a GPU until it is queued), ``apply delta``, ``load``
        (copies into the weights, queued on a GPU), ``backup``, ``device finish`` (waiting for the device at the
        end), ``idle`` (between the server's requests), ``commit``."""
        return dict(self.last_phases)

    def abort_session(self):
        restored = self.model.rollback_session()
        self._end_session()
        self.bucket_count = 0
        self.deltas.abort()  # bytes held for deltas changed in place are no longer the committed ones
        return f"restored {restored} tensors"

    def release_memory(self, tags):
        """SGLang's tags: ``weights`` frees the weights (re-created, zeroed, by ``resume_memory``; an update
        must then load every tensor before the engine serves again); this engine keeps no KV cache and
        captures no CUDA graphs, so ``kv_cache`` and ``cuda_graph`` free nothing."""
        self._forget_weight_views()
        self.receive_buffers.clear()
        freed = self.model.release_weights() if "weights" in tags else 0
        return {"freed_bytes": freed, **self.memory()}

    def resume_memory(self, tags):
        self._forget_weight_views()
        restored = self.model.resume_weights() if "weights" in tags else 0
        return {"restored_bytes": restored, **self.memory()}

    def _forget_weight_views(self) -> None:
        """Drop what holds views of our weights' storage (the programs, the plans' copies, the exports): the
        storage is about to go away, or has been made anew."""
        self.programs.clear()
        self.ipc_plans.clear()
        self.exports.clear()

    def release_ipc(self, client):
        """Close the buffers a trainer ``client`` kept mapped here (it is done with this engine)."""
        held = len(self.ipc_kept) if client == self.ipc_client else 0
        if client == self.ipc_client:
            self._trainer_gone()
        return {"released": held}

    def _close_ipc_buffers(self, ids: list[int] | None) -> None:
        """Drop kept IPC buffers (``None``: all), with the batched copies made out of them, which hold views
        of them: a buffer is closed once nothing refers to it."""
        for i in list(self.ipc_kept) if ids is None else ids:
            self.ipc_kept.pop(i, None)
        for programs in self.ipc_plans.values():
            for program in programs:
                program.copies.clear()

    def memory(self):
        """This worker's memory: the device's allocated bytes (CUDA) and the process's resident size."""
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        cuda = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        peak = torch.cuda.max_memory_allocated(self.device) - self.session_base if cuda is not None else None
        return {"rss_bytes": rss, "cuda_allocated_bytes": cuda, "session_peak_extra_cuda_bytes": peak,
                "backup_place": self.model.backup_at.where, "backup_why": self.model.backup_at.why,
                "backup_bytes": self.model.backup_bytes, "ipc_buffers_opened": self.ipc_opened,
                "ipc_buffers_held": len(self.ipc_kept), "direct_updates": self.direct_updates,
                "ipc_lease": self.ipc_lease is not None, "fds": len(os.listdir("/proc/self/fd")),
                "groups_warmed": self.groups_warmed, "programs_kept": len(self.programs),
                "program_tensors_kept": self.programs.tensors, "program_tensors_bound": self.programs.capacity,
                "ipc_plans_kept": len(self.ipc_plans), "exports_kept": len(self.exports),
                "delta_buckets_held": len(self.deltas)}

    def logits(self, input_ids):
        """Rank 0's logits as a numpy array: it crosses the pipe by value, so no shared storage of a reply (a
        descriptor and a socket to torch's memory manager) outlives it in this process."""
        out = self.model.logits(torch.tensor(input_ids))
        return out.float().cpu().numpy() if self.rank == 0 else None

    def generate(self, rows, max_new_tokens):
        """Greedy: each row's ``max_new_tokens`` new tokens, the rows one after another. Between two decode
        steps, work past the command's deadline stops (:class:`OutOfTime`, saying how far it got)."""
        outs = []
        for r, row in enumerate(rows):
            out: list[int] = []
            for step in range(max_new_tokens):
                if self._out_of_time():
                    raise OutOfTime(f"stopped in row {r} of {len(rows)} after {step} of its {max_new_tokens} "
                                    "new tokens")
                out += self.model.generate(list(row) + out, 1)
            outs.append(out)
        return outs

    deadline: float | None = None  # the running command's (see _run): time.monotonic() past which work stops

    def _out_of_time(self) -> bool:
        """Whether the running command's deadline has passed, as every rank of the engine agrees (one small
        all-reduce at TP > 1: no rank starts a forward pass that another has given up)."""
        late = self.deadline is not None and time.monotonic() > self.deadline
        if self.size == 1:
            return late
        flag = torch.tensor([int(late)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        """What the server may ask of this worker: per request type, what runs it (given the request)."""
        return {
            InitGroup: self.init_group, DestroyGroup: lambda r: self.destroy_group(r.group_name),
            DestroyAllGroups: lambda _: self.destroy_all_groups(), Receive: self.receive,
            IpcReceive: self.receive_ipc, TensorReceive: self.receive_tensor,
            ReleaseIpc: lambda r: self.release_ipc(r.client), BeginSession: lambda _: self.begin_session(),
            PrepareSession: lambda _: self.prepare_session(), CommitSession: lambda _: self.commit_session(),
            AbortSession: lambda _: self.abort_session(), ReleaseMemory: lambda r: self.release_memory(r.tags),
            ResumeMemory: lambda r: self.resume_memory(r.tags), Memory: lambda _: self.memory(),
            Logits: lambda r: self.logits(r.input_ids), Generate: lambda r: self.generate(r.rows, r.max_new_tokens),
            DeltaChecksums: lambda _: self.delta_checksums(), UpdatePhases: lambda _: self.update_phases(),
            Layout: lambda _: self.layout(), WeightChecksums: lambda r: self.weight_checksums(r.names),
            ForgetDelta: lambda _: self.forget_delta(),
        }

def _fixed_mmap_threshold() -> None:
    """glibc raises its mmap threshold after each large free, after which buffers of a bucket's size come
    from the heap; with gloo's threads coming and going with each weight-update group, the heap then
    fragments and the resident size creeps up (about 0.3 MB per group formed, measured). Keeping the
    threshold at glibc's initial 128 KiB maps large buffers and gives them back whole."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _loopback_store(port: int, rank: int, size: int, timeout: timedelta) -> dist.TCPStore:
    """The store of the engine's own TP group, reachable on loopback only: rank 0 hands torch a socket it
    bound to 127.0.0.1 (torch's own listener takes every interface), the other ranks connect to it."""
    if rank != 0:
        return tcp_store("127.0.0.1", port, is_master=False, world_size=size, timeout=timeout)
    listener = socket.create_server(("127.0.0.1", port), backlog=max(size, 8))
    return dist.TCPStore("127.0.0.1", port, size, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def worker_main(rank, size, model_dir, port, backend, device, dtype, conn, rollback=True,
                gloo_interface: str | None = None, ep: int = 1, checks: LoadChecks = DEFAULT_CHECKS,
                worker_type: type[Worker] = Worker) -> None:
    """``gloo_interface``: where gloo's listeners go (``GLOO_SOCKET_IFNAME``, unless the user set it): the
    interface of the engine's HTTP address. ``ep``: the engine's expert parallelism (:class:`Worker`). ``checks``:
    what the values of an update are checked for (:class:`~weightstream.receiver.values.LoadChecks`).
    ``worker_type``: the :class:`Worker` (or a subclass of it) that serves the commands."""
    die_with_parent()  # the kernel ends this worker when the engine's main process dies, however it dies
    _fixed_mmap_threshold()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if gloo_interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", gloo_interface)
    torch.set_num_threads(1)
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        timeout = timedelta(seconds=120)
        store = _loopback_store(port, rank, size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        worker = worker_type(rank, size, model_dir, torch.device(device), dtype_from_name(dtype), ep)
        worker.model.rollback = rollback
        worker.checks = checks
        conn.send(Reply(START_ID, Outcome.DONE, "ready"))
    except BaseException:  # noqa: BLE001
        conn.send(Reply(START_ID, Outcome.FAILED, traceback.format_exc()))
        return
    _serve(worker, conn)
    for name in list(worker.groups):
        destroy_group(worker.groups.pop(name))
    dist.destroy_process_group()


def _serve(worker: Worker, conn: Connection) -> None:
    """Run the server's commands until it says ``shutdown`` (or its end of the pipe closes), answering each with
    one :class:`Reply` that carries the command's id."""
    handlers = worker.handlers()
    while True:
        start = time.perf_counter()
        try:
            command = worker.next_command(conn)
        except EOFError:
            return
        if worker.in_session:
            worker.clock.add("idle", time.perf_counter() - start)
        if isinstance(command.request, Shutdown):
            conn.send(Reply(command.id, Outcome.DONE, "bye"))
            return
        conn.send(_run(worker, handlers, command))


def _run(worker: Worker, handlers: dict[type, Callable[[Any], Any]], command: Command) -> Reply:
    """One command's reply: what it returned, or why it failed or stopped at its deadline."""
    run = handlers.get(type(command.request))
    if run is None:
        known = ", ".join(sorted(t.__name__ for t in handlers))
        return Reply(command.id, Outcome.FAILED,
                     f"unknown request {type(command.request).__name__} (known: {known})")
    worker.deadline = command.deadline
    try:
        return Reply(command.id, Outcome.DONE, run(command.request))
    except OutOfTime as exc:
        return Reply(command.id, Outcome.OUT_OF_TIME, str(exc))
    except BaseException as exc:  # noqa: BLE001 — reported to the server, the worker lives on
        return Reply(command.id, Outcome.FAILED, f"{type(exc).__name__}: {exc}")
    finally:
        worker.deadline = None
