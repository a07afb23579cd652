"""``ReshardSink``: per-rank (P2P) delivery into an engine of any TP, from a trainer of any TP and EP.

The engine declares how it splits each HF tensor over its ranks (:data:`~weightstream.engines.base.RESHARD`,
an :class:`~weightstream.streaming.reshard.EngineLayout`). Once per stream plan every sending rank's bucket
metadata is gathered and each bucket is planned (:func:`~weightstream.streaming.reshard.plan_bucket`): each
trainer rank sends each engine rank exactly the rows or columns of the tensors it holds that the engine rank
needs, so no rank gathers a tensor. A route that is the sender's whole bucket goes as it is; any other is packed
into a buffer of its own (one batched copy per dtype). Where the plan is trainer rank r's bucket to engine rank
r and nothing else (the engine's layout is the trainer's), the engine is told so as a plain per-rank bucket.

Deltas: each sender encodes the bytes of each of its routes against its snapshot of them (kept per bucket and
engine rank); engine rank e reports, per bucket, the checksums of the bytes each sender's route gave it, joined
in sender order, which trainer rank 0 checks against the senders' own (:meth:`ReshardSink.share_digests`).

The senders: for each (TP, expert-TP, EP) coordinate of the first pipeline stage, its first data-parallel
replica; sender i is group rank i, the engine's rank e group rank ``senders + e``. Trainer rank 0 is sender 0:
it talks to the engine and hosts the group's store.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weightstream.common.processes import free_port
from weightstream.engines.base import (
    P2P_AHEAD,
    RESHARD,
    EngineAdapter,
    GroupSpec,
    P2PAheadEngine,
    RankBucket,
    ReshardEngine,
    capable,
    implementing,
)
from weightstream.errors import UpdateError
from weightstream.sinks.base import Delivery
from weightstream.sinks.broadcast import default_backend
from weightstream.sinks.pipelined import InFlight, PipelinedSink, Sends, deltas_ahead, header_tensor
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import Bucket, typed_buffer, view_tensor
from weightstream.streaming.delta import DeltaHeader, Key, Snapshot, word_size
from weightstream.streaming.reshard import EngineLayout, Route, is_identity, off_grid, plan_bucket
from weightstream.wire.groups import WARM_SENDS, GroupLayout, init_custom_process_group
from weightstream.wire.handles import checksum

if TYPE_CHECKING:
    from weightstream.streaming.stream import BucketStream


__all__ = ["Roster", "pick_senders", "ReshardSink", "expected_digests"]


@dataclass(frozen=True)
class Roster:
    """Who sends: the senders' ranks in the trainer's job, in sender order; this rank's index among them (None:
    it sends nothing); the engine's layout and the port of the group's store (from trainer rank 0)."""

    senders: tuple[int, ...]
    me: int | None
    layout: EngineLayout
    port: int


def pick_senders(coords: list[tuple[int, int, int, int, int]]) -> tuple[int, ...]:
    """Per rank of the job, ``(pp, dp, tp, etp, ep)``: the ranks that send, one per (TP, expert-TP, EP)
    coordinate of the first pipeline stage (its lowest data-parallel replica), ordered by (EP, TP, expert-TP)."""
    best: dict[tuple[int, int, int], tuple[int, int]] = {}
    for rank, (pp, dp, tp, etp, ep) in enumerate(coords):
        if pp != 0:
            continue
        key = (ep, tp, etp)
        if key not in best or (dp, rank) < best[key]:
            best[key] = (dp, rank)
    return tuple(best[k][1] for k in sorted(best))


class ReshardSink(PipelinedSink):
    name = "p2p"

    def __init__(self, engine: EngineAdapter, topology: Topology, *, master_address: str = "127.0.0.1",
                 master_port: int | None = None, backend: str | None = None, timeout_s: float = 60.0,
                 checksums: bool = False, delta: Snapshot | None = None):
        """``delta``: this rank's snapshot of the bytes of its routes (a delta-mode update, where it is active)."""
        self.engine = implementing(engine, RESHARD, ReshardEngine)
        self.delta = delta
        self.topology = topology
        self.master_address, self.master_port = master_address, master_port
        self.backend = backend or default_backend()
        self.timeout_s, self.checksums = timeout_s, checksums
        self.sender = False  # known once the roster is (_roster)
        self.ahead_used = False  # the last update told the engine of every bucket ahead (P2P_AHEAD)
        self.group = None
        self.roster: Roster | None = None
        self.routes: list[list[Route]] = []  # per bucket, every route (the poster tells the engine of them all)
        self.identity: list[bool] = []  # per bucket: trainer rank r's bucket to engine rank r, nothing else
        self.tensors = 0  # HF tensors of the plan, over every sender (a tensor split over several counted once)
        self._planned_for: Any = None  # the stream plan the routes were made for
        self._pool: ThreadPoolExecutor | None = None
        self._inflight = InFlight(timeout_s, [engine.url])

    # -- who sends, and what ---------------------------------------------------------------

    def _world(self) -> tuple[int, int]:
        if not dist.is_available() or not dist.is_initialized():
            return 0, 1
        group = self.topology.world_group
        return dist.get_rank(group), dist.get_world_size(group)

    def _gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank of the trainer's job (one collective; alone: itself)."""
        _, size = self._world()
        if size == 1:
            return [obj]
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, obj, group=self.topology.world_group)
        return everyone

    def _roster(self) -> Roster:
        """Who sends (one collective of the whole job, once): trainer rank 0 asks the engine for its layout and
        picks the store's port; a failure there is raised on every rank."""
        if self.roster is not None:
            return self.roster
        rank, _ = self._world()
        topo = self.topology
        told: Any = None
        if rank == 0:
            try:
                told = (self.engine.layout(), self.master_port or free_port())
            except Exception as exc:  # noqa: BLE001 — raised on every rank below
                told = UpdateError("connect", f"the engine's layout: {exc}", [self.engine.url])
        everyone = self._gather(((topo.pp_rank, topo.dp_rank, topo.tp_rank, topo.etp_rank, topo.ep_rank), told))
        told = everyone[0][1]
        if isinstance(told, BaseException):
            raise told
        senders = pick_senders([c for c, _ in everyone])
        if senders[0] != 0:
            raise UpdateError("group", f"trainer rank 0 is not the first sender ({senders})", [self.engine.url])
        me = senders.index(rank) if rank in senders else None
        self.roster = Roster(senders, me, told[0], told[1])
        self.sender = me is not None
        return self.roster

    def _plan(self, stream: BucketStream) -> None:
        """The routes of every bucket, made once per stream plan: every sender's bucket metadata gathered (one
        collective of the whole job), each bucket planned alike on every rank."""
        key = stream.shared
        if key is not None and key is self._planned_for and not stream.stats.planned:
            return
        roster = self._roster()
        metas = [stream.bucket_metas(i) for i in range(len(stream))] if roster.me is not None else None
        everyone = self._gather(metas)
        senders = [everyone[r] for r in roster.senders]
        if stream.quantization is not None:
            wrong = off_grid(senders, roster.layout, stream.quantization.fp8.block)
            if wrong:
                raise ValueError(f"block FP8 cannot be resharded into this engine's layout: {'; '.join(wrong)} (its "
                                 "ranks hold such parts dequantized; transport='broadcast' sends the tensors whole)")
        self.routes = [plan_bucket([s[i] for s in senders], roster.layout, stream.align) for i in range(len(stream))]
        self.identity = [is_identity(r, len(senders)) and roster.layout.size == len(senders) for r in self.routes]
        self.tensors = len({m.name for s in senders for bucket in s for m in bucket})
        self._planned_for = key

    # -- the group -------------------------------------------------------------------------

    def layout(self) -> GroupLayout | None:
        """The group as this rank sees it (no communication). Before the roster is known, only where the trainer
        has one sender (TP, EP and expert-TP 1: trainer rank 0, whose engine adapter already knows the engine's
        TP): the group a broadcast to the same engine forms, so that the two sinks hand it over."""
        roster, topo = self.roster, self.topology
        if roster is not None:
            if roster.me is None:
                return None
            me, n, size = roster.me, len(roster.senders), roster.layout.size
        elif (topo.tp_size, topo.ep_size, topo.etp_size, topo.pp_rank, topo.dp_rank) == (1, 1, 1, 0, 0):
            me, n, size = 0, 1, self.engine.info().tp_size
        else:
            return None
        return GroupLayout(self.master_address, self.backend, self.engine.group_name, self.timeout_s, n + size, me,
                           ((self.engine.url, n),))

    def prepare(self, stream: BucketStream) -> None:
        self._plan(stream)

    def connect(self) -> None:
        roster = self._roster()
        me = roster.me
        if self.group is not None or me is None:
            return
        n, world = len(roster.senders), len(roster.senders) + roster.layout.size
        posts = []
        warm = self._warming([self.engine], WARM_SENDS)  # (every sender asks the same engine)
        if me == 0:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ws-reshard")
            posts.append(self._pool.submit(self.engine.join_group, GroupSpec(
                self.master_address, roster.port, n, world, self.backend, self.timeout_s, self.engine.group_name,
                warm, n)))
        self._join(posts, lambda: self._form(lambda: init_custom_process_group(
            self.backend, f"tcp://{self.master_address}:{roster.port}", world, me, self.engine.group_name,
            self.timeout_s), warm, n), [self.engine.url])

    def disconnect(self, seconds: float | None = None) -> None:
        if self.sender and self.roster is not None:
            self._leave([self.engine] if self.roster.me == 0 else [], self.timeout_s if seconds is None else seconds)

    def open(self, stream: BucketStream) -> None:
        """Plan and connect; where the engine takes it (``p2p_ahead``; in a delta-mode update ``delta_ahead`` too)
        and no checksums are asked for, sender 0 tells it of every bucket's routes now: the buckets then go on the
        wire back to back (each delta payload behind its header, from its sender)."""
        if stream.mode != "per_rank":
            raise ValueError("ReshardSink needs a per_rank stream")
        self._begin_update()
        self._plan(stream)
        self.connect()
        self._ahead = []
        ahead = capable(self.engine, P2P_AHEAD, P2PAheadEngine)
        delta = self._active_snapshot() is not None
        self.ahead_used = (self.sender and ahead is not None and not self.checksums and len(stream) > 0
                           and (not delta or deltas_ahead([self.engine])))
        if self.ahead_used and ahead is not None and self._roster().me == 0:
            self._post_ahead([partial(ahead.receive_p2p_ahead, self._ahead_buckets(), delta=delta)],
                             len(self.routes))

    def _ahead_buckets(self) -> list[list[RankBucket]]:
        """What the engine is told ahead: where every bucket is trainer rank r's to engine rank r (the layouts are
        the same), plain per-rank buckets, which the engine receives while it loads the last (batched copies);
        else every route as pieces naming its engine rank (an identity bucket's one piece per rank tiles its
        part)."""
        if all(self.identity):
            return [self._told(i, {}, {}) for i in range(len(self.routes))]
        return [[RankBucket(r.sender, r.metas, r.nbytes, None, None, rank=r.engine_rank) for r in routes]
                for routes in self.routes]

    def delivery(self) -> Delivery:
        return replace(super().delivery(), tensors=self.tensors, metadata_ahead=self.ahead_used)

    def close(self) -> None:
        if self.sender:
            self._finish_ahead()
            self._close_ahead([self.engine.url])

    # -- the buckets -----------------------------------------------------------------------

    def send(self, bucket: Bucket) -> None:
        failure: UpdateError | None = None
        if self.sender:
            try:
                self._finish_ahead(every=False)
            except UpdateError as exc:
                failure = exc
        roster = self._roster()
        mine = [r for r in self.routes[bucket.index] if r.sender == roster.me]
        buffers = [bucket.buffer if r.whole_bucket else _packed(bucket, r) for r in mine]
        headers: dict[tuple[int, int], DeltaHeader] = {}
        snapshot = self._active_snapshot()
        if snapshot is not None:
            buffers = [_encode(snapshot, bucket, r, b, headers) for r, b in zip(mine, buffers, strict=True)]
        digests = ({(r.sender, r.engine_rank): checksum(b) for r, b in zip(mine, buffers, strict=True)}
                   if self.checksums else {})
        if (self.checksums or snapshot is not None) and len(roster.senders) > 1:
            # Every rank meets here for every bucket: the checksums and delta headers reach the poster, and a
            # failure seen by one (the poster hears the engine) is raised by all, so that none waits for a rank
            # that stopped.
            for d, h, f in self._gather((digests, headers, failure)):
                digests.update(d)
                headers.update(h)
                failure = failure or f
        if failure is not None:
            raise failure
        if not self.sender:
            return
        posts = []
        if roster.me == 0 and not self.ahead_used:
            told = self._told(bucket.index, digests, headers)
            posts.append(self._engine_pool().submit(self.engine.receive_p2p, bucket.index, told))
        n = len(roster.senders)
        sent = [(r.engine_rank, b) for r, b in zip(mine, buffers, strict=True)]
        if self.ahead_used and snapshot is not None:  # each route's header first, on the wire (delta_ahead)
            sent = [pair for r, b in zip(mine, buffers, strict=True) for pair in (
                (r.engine_rank, header_tensor(headers[(r.sender, r.engine_rank)], bucket.index, b.device)),
                (r.engine_rank, b))]
        works = [dist.isend(b, group=self.group, group_dst=n + rank) for rank, b in sent]
        self._inflight.start(bucket, Sends(works, [b for _, b in sent], self.backend), posts)

    def _told(self, index: int, digests: dict[tuple[int, int], str],
              headers: dict[tuple[int, int], DeltaHeader]) -> list[RankBucket]:
        """What the engine is told of bucket ``index``: per route, the engine rank, the sender and the pieces (or,
        a delta, the payload that gives them)."""
        told = []
        for r in self.routes[index]:
            key = (r.sender, r.engine_rank)
            header = headers.get(key)
            nbytes = r.nbytes if header is None else header.nbytes
            # identity: a plain per-rank bucket, trainer rank r to engine rank r
            rank = None if self.identity[index] else r.engine_rank
            told.append(RankBucket(r.sender, r.metas, nbytes, digests.get(key), header, rank=rank))
        return told

    def _active_snapshot(self) -> Snapshot | None:
        """The snapshot, where this update's routes go through it (a delta-mode update, full or not)."""
        return self.delta if self.delta is not None and self.delta.active else None

    def share_digests(self) -> None:
        """A delta-mode update, on every rank once every rank's buckets went through: the checksums of each
        sender's routes (its snapshot's) go to trainer rank 0's snapshot as what each engine rank must report per
        bucket (``Snapshot.expected``): those of the routes to it, joined in sender order."""
        snapshot = self._active_snapshot()
        if snapshot is None:
            return
        roster = self._roster()
        everyone = self._gather(snapshot.digests if roster.me is not None else None)
        if self._world()[0] == 0:
            snapshot.expected = {self.engine.url: expected_digests([everyone[r] for r in roster.senders],
                                                                   roster.layout.size)}


def _encode(snapshot: Snapshot, bucket: Bucket, route: Route, new: torch.Tensor,
            headers: dict[tuple[int, int], DeltaHeader]) -> torch.Tensor:
    """The payload of ``route``'s bytes ``new`` against the sender's ``snapshot`` of them (its header into
    ``headers``)."""
    header, payload = snapshot.encode((bucket.index, route.engine_rank), new, word_size(new.numel(), (bucket.word,)))
    headers[(route.sender, route.engine_rank)] = header
    return payload


def expected_digests(senders: list[dict[Key, str]], engine_ranks: int) -> list[dict[Key, str]]:
    """Per engine rank, per bucket: the checksums of the bytes each sender's route gave it (``senders``: each
    sender's, keyed by (bucket, engine rank)), joined with ``+`` in sender order; what the engine reports."""
    out: list[dict[Key, list[str]]] = [{} for _ in range(engine_ranks)]
    for digests in senders:
        for key, digest in digests.items():
            if isinstance(key, tuple):
                index, rank = key
                out[rank].setdefault(index, []).append(digest)
    return [{i: "+".join(ds) for i, ds in rank.items()} for rank in out]


def _packed(bucket: Bucket, route: Route) -> torch.Tensor:
    """The pieces of ``route`` cut from ``bucket`` into a buffer of their own, laid out as ``route.metas`` (one
    batched copy per dtype)."""
    out = typed_buffer(route.nbytes, bucket.buffer.device).zero_()  # gaps zero: a delta compares every word
    pairs: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for piece, meta in zip(route.pieces, route.metas, strict=True):
        src = view_tensor(bucket.buffer, bucket.metas[piece.source])
        if piece.cut is not None:
            src = src.narrow(*piece.cut)
        dst, srcs = pairs.setdefault(meta.dtype, ([], []))
        dst.append(view_tensor(out, meta))
        srcs.append(src)
    for dst, srcs in pairs.values():
        torch._foreach_copy_(dst, srcs)
    return out
