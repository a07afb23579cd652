"""``P2PSink``: per-rank delivery. With ``mode="per_rank"`` trainer TP rank r sends its bucket straight
to engine TP rank r (send/recv), so no gather happens anywhere.

Several engines (replicas of one model, each at the trainer's TP): engine j is served by the trainer's
data-parallel replica ``j % dp`` (its first pipeline stage), so that the replicas share the sending. Each replica
forms one group with the engines it serves: its TP ranks (group ranks 0..tp-1), then each engine's ranks
(``tp (1 + i)`` onwards for its i-th engine), and each TP rank sends each bucket to its rank in every one of them.
With one engine and TP 1 that is the group a broadcast to the same engine forms: a sink switching between the
two hands the group over rather than forming it again."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from weightstream.common.processes import free_port
from weightstream.engines.base import (
    P2P,
    P2P_AHEAD,
    EngineAdapter,
    GroupSpec,
    P2PAheadEngine,
    P2PEngine,
    RankBucket,
    capable,
    implementing,
)
from weightstream.errors import UpdateError
from weightstream.sinks.base import Delivery
from weightstream.sinks.broadcast import default_backend
from weightstream.sinks.pipelined import InFlight, PipelinedSink, Sends, deltas_ahead, header_tensor
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import Bucket, TensorMeta, extent
from weightstream.streaming.delta import DeltaHeader, Key, Snapshot
from weightstream.wire.groups import WARM_SENDS, GroupLayout, init_custom_process_group
from weightstream.wire.handles import checksum

if TYPE_CHECKING:

    from weightstream.streaming.stream import BucketStream


__all__ = ["served_by", "P2PSink"]


def served_by(engines: int, dp_size: int, dp_rank: int) -> list[int]:
    """The engines (their indices) data-parallel replica ``dp_rank`` of ``dp_size`` sends to: engine j goes to
    replica ``j % dp_size``."""
    return [j for j in range(engines) if j % dp_size == dp_rank]


class P2PSink(PipelinedSink):
    name = "p2p"

    def __init__(self, engines: Sequence[EngineAdapter], topology: Topology, *, master_address: str = "127.0.0.1",
                 master_port: int | None = None, backend: str | None = None, timeout_s: float = 60.0,
                 checksums: bool = False, delta: Snapshot | None = None):
        """``topology``: this trainer rank's coordinates (the source's): the ranks of the first pipeline stage
        of data-parallel replica d send to engines d, d + dp, ..., TP rank r to each one's TP rank r. ``delta``:
        this rank's snapshot of the bytes its engine ranks hold (the same on each of its engines); each bucket
        then goes out as it encodes it (the engines must declare ``delta``), and :meth:`close` gathers every TP
        rank's checksums of its new bytes for the check (:meth:`share_digests`: to trainer rank 0)."""
        if not engines:
            raise ValueError("P2PSink needs an engine")
        self.all_engines = [implementing(e, P2P, P2PEngine) for e in engines]
        self.engines = [self.all_engines[j] for j in served_by(len(engines), topology.dp_size, topology.dp_rank)]
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend or default_backend()
        self.timeout_s = timeout_s
        self.checksums = checksums
        self.sender = topology.pp_rank == 0 and bool(self.engines)
        self.tp_rank, self.tp, self.tp_group = topology.tp_rank, topology.tp_size, topology.tp_group
        self.world_group = topology.world_group
        self.replica = topology.dp_rank
        self.poster = self.sender and self.tp_rank == 0
        self._sent_digests: list[dict[Key, str]] = []  # a delta update's, of this replica's TP ranks (close)
        self.group = None
        self.stream: BucketStream | None = None
        self.ahead_used = False  # the last update told the engines of every bucket ahead (P2P_AHEAD)
        self.delta = delta
        self._pool: ThreadPoolExecutor | None = None
        self._inflight = InFlight(timeout_s, [e.url for e in self.engines])

    @property
    def group_name(self) -> str:
        return self.all_engines[0].group_name

    def _offset(self, i: int) -> int:
        """The group rank of this replica's i-th engine's TP rank 0."""
        return self.tp * (1 + i)

    def layout(self) -> GroupLayout | None:
        """Trainer TP rank r is rank r, the i-th engine's TP rank r is rank ``tp (1 + i) + r``: with one engine at TP
        1 the very group a broadcast to the same engine forms (:meth:`PipelinedSink.hand_over`)."""
        if not self.sender:
            return None
        return GroupLayout(self.master_address, self.backend, self.group_name, self.timeout_s,
                           self._offset(len(self.engines)), self.tp_rank,
                           tuple((e.url, self._offset(i)) for i, e in enumerate(self.engines)))

    def connect(self) -> None:
        if self.group is not None or not self.sender:
            return
        # The TCP store lives on the replica's TP rank 0; everyone needs its port (a port given: replica d's is
        # that port + d, so that replicas on one host do not clash).
        port = [self.master_port + self.replica if self.master_port else (free_port() if self.poster else 0)]
        if self.tp > 1:
            dist.broadcast_object_list(port, group=self.tp_group, group_src=0)
        world = self._offset(len(self.engines))
        posts = []
        warm = self._warming(self.engines, WARM_SENDS)  # (every TP rank asks the same engines)
        if self.poster:
            self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.engines)), thread_name_prefix="ws-p2p")
            posts = [self._pool.submit(e.join_group, GroupSpec(
                self.master_address, port[0], self._offset(i), world, self.backend, self.timeout_s, self.group_name,
                warm, self.tp)) for i, e in enumerate(self.engines)]
        self._join(posts, lambda: self._form(lambda: init_custom_process_group(
            self.backend, f"tcp://{self.master_address}:{port[0]}", world, self.tp_rank, self.group_name,
            self.timeout_s,
        ), warm, self.tp), [e.url for e in self.engines])

    def disconnect(self, seconds: float | None = None) -> None:
        if self.sender:
            self._leave(self.engines if self.poster else [], self.timeout_s if seconds is None else seconds)

    def open(self, stream: BucketStream) -> None:
        """Connect; where every engine of this replica takes it (and no checksums are asked for; in a delta-mode
        update, where every engine takes its deltas so too: ``delta_ahead``), the poster tells them what each of their
        ranks receives in every bucket now: the buckets then go on the wire back to back, with no request between
        two (each delta payload behind its header)."""
        if stream.mode != "per_rank":
            raise ValueError("P2PSink needs a per_rank stream")
        self.stream = stream
        self._begin_update()
        self.connect()
        self._ahead = []
        self.ahead_used = False
        delta = self.delta is not None and self.delta.active
        if not self.sender or self.checksums or not len(stream) or (
                delta and not deltas_ahead(self.engines)):
            return
        ahead = [a for e in self.engines if (a := capable(e, P2P_AHEAD, P2PAheadEngine)) is not None]
        if len(ahead) == len(self.engines):
            self.ahead_used = True
            if self.poster:
                buckets = [self._told(i, stream.bucket_metas(i), [None] * self.tp, [None] * self.tp)
                           for i in range(len(stream))]
                self._post_ahead([partial(e.receive_p2p_ahead, buckets, delta=delta) for e in ahead], len(buckets))

    def _told(self, index: int, mine: Sequence[TensorMeta], digests: Sequence[str | None],
              headers: Sequence[DeltaHeader | None]) -> list[RankBucket]:
        """What engine rank r receives in bucket ``index``: trainer TP rank r's bucket (``mine`` on this rank)."""
        ranks = []
        for r in range(self.tp):
            metas = mine if r == self.tp_rank else self._opened().metas_for_rank(index, r)
            header = headers[r]
            nbytes = extent(metas) if header is None else header.nbytes
            ranks.append(RankBucket(r, tuple(metas), nbytes, digests[r], header))
        return ranks

    def delivery(self) -> Delivery:
        return replace(super().delivery(), metadata_ahead=self.ahead_used)

    def _opened(self) -> BucketStream:
        if self.stream is None:
            raise RuntimeError("P2PSink: send before open")
        return self.stream

    def send(self, bucket: Bucket) -> None:
        if not self.sender:
            return
        failure = self._finish_inflight(every=False)
        if self.delta is not None and self.delta.active:
            header, payload = self.delta.encode(bucket.index, bucket.buffer, bucket.word)
            bucket = Bucket(bucket.index, payload, bucket.metas, delta=header)
        digest = checksum(bucket.buffer) if self.checksums else None
        digests, headers = [digest] * self.tp, [bucket.delta] * self.tp  # gathered below where they differ
        if (self.checksums or bucket.delta is not None) and self.tp > 1 and not self.ahead_used:
            # The TP ranks meet here for every bucket (its checksums and headers go in the poster's request): a
            # failure seen by one (the poster hears the engine) is raised by all, so that none is left waiting in
            # this collective for a rank that stopped. Sent ahead (headers on the wire), they meet at close.
            everyone: list = [None] * self.tp
            dist.all_gather_object(everyone, (digest, bucket.delta, failure), group=self.tp_group)
            digests, headers = [d for d, _, _ in everyone], [h for _, h, _ in everyone]
            failure = next((f for _, _, f in everyone if f is not None), None)
        if failure is not None:
            raise failure
        posts = []
        if self.poster and not self.ahead_used:
            ranks = self._told(bucket.index, bucket.metas, digests if self.checksums else [None] * self.tp, headers)
            posts = [self._engine_pool().submit(e.receive_p2p, bucket.index, ranks) for e in self.engines]
        buffers = [bucket.buffer]
        if self.ahead_used and bucket.delta is not None:  # its header goes first, on the wire (delta_ahead)
            buffers.insert(0, header_tensor(bucket.delta, bucket.index, bucket.buffer.device))
        works = [dist.isend(b, group=self.group, group_dst=self._offset(i) + self.tp_rank)
                 for i in range(len(self.engines)) for b in buffers]
        self._inflight.start(bucket, Sends(works, buffers, self.backend), posts)

    def _finish_inflight(self, every: bool = True) -> UpdateError | None:
        """Finish the buckets in flight (``every``; else as the next bucket starts); a failure, kept to raise once
        the TP ranks have met."""
        try:
            self._finish_ahead(every)
        except UpdateError as exc:
            return exc
        return None

    def close(self) -> None:
        """Finish the bucket in flight; in a delta update, every TP rank's checksums of its buckets' new bytes are
        gathered on the replica's TP ranks (what rank r of each of its engines must report, for
        :meth:`share_digests`), the TP ranks meeting whether or not one of them failed."""
        if not self.sender:
            return
        if self.delta is None or not self.delta.active:
            self._finish_ahead()
            self._close_ahead([e.url for e in self.engines])
            return
        failure = self._finish_inflight()
        everyone: list = [(self.delta.digests, failure)]
        if self.tp > 1:
            everyone = [None] * self.tp
            dist.all_gather_object(everyone, (self.delta.digests, failure), group=self.tp_group)
        self._sent_digests = [d for d, _ in everyone]
        failure = next((f for _, f in everyone if f is not None), None)
        if failure is not None:
            raise failure

    def share_digests(self) -> None:
        """A delta-mode update, on every rank once every rank's buckets went through: what each engine's ranks
        must report (the checksums of its replica's TP ranks) reaches trainer rank 0's snapshot
        (``Snapshot.expected``), which checks every engine against them."""
        if self.delta is None or not self.delta.active:
            return
        mine = {e.url: self._sent_digests for e in self.engines} if self.poster else {}
        everyone: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.world_group) > 1:
            everyone = [None] * dist.get_world_size(self.world_group)
            dist.all_gather_object(everyone, mine, group=self.world_group)
        if not dist.is_initialized() or dist.get_rank(self.world_group) == 0:
            self.delta.expected = {url: ranks for sent in everyone for url, ranks in sent.items()}
