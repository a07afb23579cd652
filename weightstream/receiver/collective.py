"""The receives over a weight-update group (torch.distributed): one pipeline per transport (broadcast, P2P,
resharded P2P), each taking a :class:`~weightstream.receiver.plan.Receive` whose plan says how the buckets come
(every bucket named ahead and received back to back, or one per request; deltas or whole buckets)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from weightstream.models.spec import dtype_from_name
from weightstream.receiver import value_kernel
from weightstream.receiver.ahead_plans import KEPT_AHEAD_PLANS, AheadPlans, HeldPlan, KeyedReceive
from weightstream.receiver.pieces import assemble, piece_problems
from weightstream.receiver.plan import DenseBucket, RankBucket, Receive, Transport
from weightstream.receiver.programs import CopyProgram, PiecesProgram, dense_layout, wire_meta
from weightstream.receiver.session import UpdateSession
from weightstream.receiver.transfer import Pipeline, ReceiveBuffers, receive_header, receive_payload
from weightstream.streaming.bucket import Bucket, TensorMeta, extent, typed_buffer, view_tensor
from weightstream.streaming.delta import HEADER_WORDS, DeltaHeader
from weightstream.wire.handles import checksum

__all__ = ["CollectiveReceiver"]


class CollectiveReceiver:
    """One rank's receives over weight-update groups, loaded through ``session``; on a GPU, buckets sent ahead
    (whole) come into the two buffers of ``buffers``, kept across updates. The broadcast plans sent ahead by key
    (:class:`KeyedReceive`) that loaded or were prepared are kept in ``plans`` (at most ``kept_plans``), with their
    programs: a plan sent again by its key alone crosses from the engine as a key, and loads by the programs in
    hand."""

    def __init__(self, session: UpdateSession, buffers: ReceiveBuffers, kept_plans: int = KEPT_AHEAD_PLANS):
        self.session, self.buffers = session, buffers
        self.device = session.at.device
        self.clock = session.at.clock
        self.plans: AheadPlans[HeldPlan] = AheadPlans(kept_plans)
        self.plans_by_key = 0  # keyed commands that named no bucket: the plan was this rank's
        self.plans_sent = 0  # keyed commands that brought the plan's buckets

    def receive(self, group: Any, r: Receive) -> dict[str, Any] | None:
        """One receive over ``group``, by its plan's transport."""
        if r.plan.transport is Transport.BROADCAST:
            return self._receive_broadcast(group, r)
        if r.plan.transport is Transport.P2P:
            return self._receive_p2p(group, r)
        return self._receive_pieces(group, r)

    def receive_keyed(self, group: Any, k: KeyedReceive) -> dict[str, Any]:
        """A broadcast sent ahead whose plan the engine keeps by ``k.key``: its buckets those this rank keeps where
        the command names none (:meth:`held_plan`), received and loaded by the plan's programs; the plan kept once
        they have loaded. The answer names the keys this rank holds after it (``plans``)."""
        plan = self.held_plan(k)
        assert plan.programs is not None  # (resolved by held_plan)
        done = self._receive_ahead(group, k.receive, plan.programs)
        self.plans.put(k.key, plan)
        return {**done, "plans": self.plans.keys()}

    def prepare_keyed(self, k: KeyedReceive) -> dict[str, Any]:
        """:meth:`prepare` of the plan ``k.key`` names (:meth:`held_plan`), kept under it; the answer names the keys
        this rank holds after it (``plans``)."""
        plan = self.held_plan(k)
        assert plan.programs is not None  # (resolved by held_plan)
        done = self._prepare(plan.buckets, plan.programs)
        self.plans.put(k.key, plan)
        return {**done, "plans": self.plans.keys()}

    def held_plan(self, k: KeyedReceive) -> HeldPlan:
        """The plan of ``k``, its programs in hand: the one kept under its key where the command names no bucket
        (refused where none is kept: the engine sent the key alone to a rank that did not name it), else a new one of
        the buckets it names. Programs are made where the plan has none (new, or its weights moved since)."""
        if k.by_key:
            plan = self.plans.get(k.key)
            if plan is None:
                raise RuntimeError(f"engine rank {self.session.at.rank} keeps no plan by key {k.key} (it keeps "
                                   f"{self.plans.keys()}): the engine sent the key alone where this rank had not "
                                   "named it, and had to send the plan's buckets")
            self.plans_by_key += 1
        else:
            plan = HeldPlan(k.receive.buckets)
            self.plans_sent += 1
        if plan.programs is None:
            plan.programs = tuple(self._dense_program(b) for b in plan.buckets)
        return plan

    def forget_programs(self) -> None:
        """The weights' storage is about to go away, or has been made anew: the kept plans' programs, which hold views
        of it, are dropped (each plan's are made again at its next use; its buckets are kept)."""
        for plan in self.plans.values():
            plan.programs = None

    def stats(self) -> dict[str, int]:
        """The broadcast plans kept (``broadcast_plans_kept``; of them, those whose programs are to be made again:
        ``broadcast_plans_unresolved``), and how the keyed commands came: by key alone (``broadcast_plans_by_key``),
        with the plan's buckets (``broadcast_plans_sent``)."""
        return {"broadcast_plans_kept": len(self.plans),
                "broadcast_plans_unresolved": sum(p.programs is None for p in self.plans.values()),
                "broadcast_plans_by_key": self.plans_by_key, "broadcast_plans_sent": self.plans_sent}

    def prepare(self, r: Receive) -> dict[str, Any]:
        """Before the update that brings ``r``'s buckets (a broadcast sent ahead): each bucket's copy program, kept; on
        a GPU the two receive buffers, grown to the largest bucket, each program's copies out of each of them and its
        value checks' table (:func:`~weightstream.receiver.values.check_runs`), made now. The first update then loads
        as a later one does."""
        return self._prepare(r.buckets, tuple(self._dense_program(b) for b in r.buckets))

    def _prepare(self, buckets: tuple[DenseBucket, ...], programs: tuple[CopyProgram, ...]) -> dict[str, Any]:
        """:meth:`prepare` of ``buckets``, whose ``programs`` are in hand."""
        for bucket, program in zip(buckets, programs, strict=True):
            self.session.programs.put(bucket.key, program, len(program.metas))
        pipe = Pipeline(self.buffers, [(p.total, None) for p in programs], None)
        for raw in self.buffers.buffers if pipe.cuda else ():
            for program in programs:
                if program.runs is not None:
                    program.copies_from(raw, kept=True)
                    if value_kernel.available(raw.device):
                        value_kernel.bucket_flag(raw, program.runs)
        return {"prepared": len(programs)}

    def _receive_broadcast(self, group: Any, r: Receive) -> dict[str, Any]:
        """Broadcast buckets: sent ahead, back to back (:meth:`_receive_buckets`); one per request, a delta's new
        bytes (:meth:`_receive_bucket_delta`), a flattened bucket, or each tensor broadcast alone."""
        if r.plan.ahead:
            return self._receive_ahead(group, r, tuple(self._dense_program(b) for b in r.buckets))
        bucket = r.buckets[0]
        if bucket.delta is not None or r.load_format == "flattened_bucket":
            program = self._dense_program(bucket)
            if bucket.delta is not None:
                return self._receive_bucket_delta(group, program.metas, bucket, program)
            with self.clock("receive"):
                raw = typed_buffer(program.total, self.device)
                dist.broadcast(raw.narrow(0, 0, program.total), group=group, group_src=0)
            with self.clock("load"):
                return self.session.load_dense(program, raw, bucket.checksum)
        tensors = []
        for name, dt, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True):
            t = torch.empty(shape, dtype=dtype_from_name(dt), device=self.device)
            dist.broadcast(t, group=group, group_src=0)
            tensors.append((name, t, None))
        return self.session.load(tensors)

    def _receive_ahead(self, group: Any, r: Receive, programs: tuple[CopyProgram, ...]) -> dict[str, Any]:
        """Broadcast buckets sent ahead, their ``programs`` in hand, received back to back
        (:meth:`_receive_buckets`)."""
        if r.load_format != "flattened_bucket":
            raise ValueError(f"load_format {r.load_format!r}: buckets sent ahead are flattened buckets")
        return self._receive_buckets(group, programs, [(p.total, None) for p in programs], r.plan.delta)

    def _receive_p2p(self, group: Any, r: Receive) -> dict[str, Any]:
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
            return self.session.apply(Bucket(self.session.bucket_count, buffer, metas), bucket.checksum)

    def _receive_bucket_delta(self, group: Any, metas: tuple[TensorMeta, ...], bucket: DenseBucket | RankBucket,
                              program: CopyProgram | None = None) -> dict[str, Any]:
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
            raw = self.session.deltas.new_bytes(index, metas, total, header, received, bucket.checksum)
        with self.clock("load"):
            if program is not None:
                return self.session.load_dense(program, raw, None)
            return self.session.apply(Bucket(self.session.bucket_count, raw.narrow(0, 0, total), metas), None)

    def _receive_buckets(self, group: Any, programs: Sequence[CopyProgram], wire: list[tuple[int, int | None]],
                         delta: bool) -> dict[str, Any]:
        """``programs``' buckets sent ahead, received back to back (``wire``: each one's bytes, and the group rank that
        sends it, None: broadcast from rank 0). Whole buckets are received while the last is loaded
        (:class:`Pipeline`); in delta mode each bucket's header comes first (:meth:`DeltaHeader.as_words`), then
        its payload, applied to the bytes held of it. After a failure to apply or load, the rest are still received
        but not loaded, and the failure raised at the end; a header that cannot be read leaves the size of what
        follows unknown, and is raised at once (the sender's transfers then fail within their bound)."""
        pipe = None if delta else Pipeline(self.buffers, wire, group)
        words = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device) if delta else None
        loaded, failure = 0, None
        for i, program in enumerate(programs):
            with self.clock("receive"):
                header = None if words is None else receive_header(group, words, wire[i][1], program.total,
                                                                   wire[i][0], i)
                raw = (pipe.receive(i) if pipe is not None
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
                raw = self.session.deltas.new_bytes(i, program.metas, program.total, header, raw, None)
            with self.clock("load"):
                return self.session.load_dense(program, raw, None)["loaded"]
        assert pipe is not None  # whole buckets come through the pipeline
        with self.clock("load"), pipe.loading(i):
            return self.session.load_dense(program, raw, None, kept=pipe.cuda)["loaded"]

    def _receive_delta(self, group: Any, header: DeltaHeader, index: int, src: int | None = None) -> torch.Tensor:
        """Delta bucket ``index``'s payload (:func:`receive_payload`)."""
        return receive_payload(group, header, src, self.device)

    def _p2p_program(self, metas: tuple[TensorMeta, ...], nbytes: int) -> CopyProgram:
        """A per-rank bucket's program (kept by its metadata once it has loaded), of ``nbytes`` on the wire."""
        program = self.session.programs.get(("p2p", metas))
        if program is None:
            program = self.session.program(list(metas), key=("p2p", metas))
        if program.total > nbytes:
            raise ValueError(f"a per-rank bucket of {nbytes} bytes whose tensors take {program.total}")
        return program

    def _dense_program(self, bucket: DenseBucket) -> CopyProgram:
        """A dense bucket's program: the one kept of an earlier bucket of the same names, dtypes and shapes, else a
        new one (kept once it has loaded: :meth:`UpdateSession.load_dense`)."""
        program = self.session.programs.get(bucket.key)
        if program is None:
            program = self.session.program(dense_layout(bucket.names, bucket.dtypes, bucket.shapes), key=bucket.key)
        return program

    # -- resharded: each rank's bucket in parts from several trainer ranks ----------------------------------

    def _receive_pieces(self, group: Any, r: Receive) -> dict[str, Any] | None:
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

    def _receive_parts(self, group: Any, parts: tuple[RankBucket, ...], load: bool = True) -> dict[str, Any] | None:
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
        index = self.session.bucket_count
        self.session.bucket_count += 1
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
            return self._load_pieces(index, tuple(layouts), pieces)

    def _load_pieces(self, index: int, layouts: tuple[tuple[TensorMeta, ...], ...],
                     pieces: list[tuple[TensorMeta, torch.Tensor]]) -> dict[str, Any]:
        """Resharded bucket ``index``'s ``pieces``, each copied straight into its place in the parameters in one call
        where they can be (:meth:`_pieces_program`), else put together into this rank's parts and loaded."""
        session, at = self.session, self.session.at
        program = self._pieces_program(layouts)
        if program is not None:
            session.check_values([(m.name, t) for m, t in pieces])
            copy = partial(torch._foreach_copy_, program.dests, [t for _, t in pieces])
            return session.report(session.model.load_flat(program.names, program.targets, [copy]))
        weights, problems = assemble(pieces, session.model.params, at.rank, at.size,
                                     elsewhere=session.model.elsewhere)
        if problems:
            raise ValueError(f"bucket {index} refused, nothing of it loaded: " + "; ".join(problems))
        return session.load(weights)

    def _pieces_program(self, layouts: tuple[tuple[TensorMeta, ...], ...]) -> PiecesProgram | None:
        """A resharded bucket's pieces (``layouts``: per trainer rank's part) loaded by plain copies, where they tile
        this rank's parts and each loads by one (:meth:`~weightstream.receiver.model.HeldModel.piece_targets`): the
        tensors' names, their parameters (kept as backups) and the view each piece fills; None: they go through
        ``assemble``. Made once per layout (kept with the programs, dropped when the weights move)."""
        key = ("pieces", layouts)
        programs, model, at = self.session.programs, self.session.model, self.session.at
        if key in programs:
            return programs.get(key)
        metas = [m for layout in layouts for m in layout]
        if piece_problems(metas, model.params, at.rank, at.size, elsewhere=model.elsewhere):
            return None  # refused by ``assemble``, naming every problem; nothing of it kept
        dests = model.piece_targets(metas)
        names = list(dict.fromkeys(m.name for m in metas))
        program = None if dests is None else PiecesProgram(
            tuple(names), ([model.params[n][0] for n in names],), tuple(dests))
        programs.put(key, program, len(metas))
        return program

    def _delta_parts(self, group: Any, index: int, parts: tuple[RankBucket, ...]) -> tuple[RankBucket, ...]:
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
        bytes from its payload, held per bucket and trainer rank (:meth:`HeldDeltas.new_bytes`)."""
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
            out.append(self.session.deltas.new_bytes((index, part.src), layout, total, header, payload,
                                                     part.checksum))
        return out
