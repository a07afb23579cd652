"""``P2PSink``: per-rank delivery. With ``mode="per_rank"`` trainer TP rank r sends its bucket straight
to engine TP rank r (send/recv), so no gather happens anywhere. The group holds the trainer's TP
ranks of the first pipeline stage and data-parallel replica (group ranks 0..tp-1) and the engine's
ranks (tp..2tp-1). At TP 1 that is the group a broadcast to the same engine forms: a sink switching
between the two hands the group over rather than forming it again."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch.distributed as dist

from weightstream.common.processes import free_port
from weightstream.engines.base import P2P, EngineAdapter, GroupSpec, P2PEngine, RankBucket, implementing
from weightstream.errors import UpdateError
from weightstream.sinks.base import InFlight, PipelinedSink
from weightstream.sinks.broadcast import default_backend
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import Bucket
from weightstream.streaming.delta import Snapshot
from weightstream.wire.groups import GroupLayout, init_custom_process_group
from weightstream.wire.handles import checksum

if TYPE_CHECKING:

    from weightstream.streaming.stream import BucketStream


class P2PSink(PipelinedSink):
    name = "p2p"

    def __init__(self, engine: EngineAdapter, topology: Topology, *, master_address: str = "127.0.0.1",
                 master_port: int | None = None, backend: str | None = None, timeout_s: float = 60.0,
                 checksums: bool = False, delta: Snapshot | None = None):
        """``topology``: this trainer rank's coordinates (the source's): the ranks of the first pipeline stage
        and data-parallel replica send, TP rank r to the engine's TP rank r. ``delta``: this rank's snapshot of
        the bytes its engine rank holds; each bucket then goes out as it encodes it (the engine must declare
        ``delta``), and :meth:`close` gathers every TP rank's checksums of its new bytes for the check."""
        self.engine = implementing(engine, P2P, P2PEngine)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend or default_backend()
        self.timeout_s = timeout_s
        self.checksums = checksums
        self.sender = topology.pp_rank == 0 and topology.dp_rank == 0
        self.tp_rank, self.tp, self.tp_group = topology.tp_rank, topology.tp_size, topology.tp_group
        self.poster = self.sender and self.tp_rank == 0
        self.group = None
        self.stream: BucketStream | None = None
        self.delta = delta
        self._pool: ThreadPoolExecutor | None = None
        self._inflight = InFlight(timeout_s, [engine.url])

    def layout(self) -> GroupLayout | None:
        """Trainer TP rank r is rank r, the engine's TP rank r is rank ``tp + r``: at TP 1 the very group a
        broadcast to the same engine forms (:meth:`PipelinedSink.hand_over`)."""
        if not self.sender:
            return None
        return GroupLayout(self.master_address, self.backend, self.engine.group_name, self.timeout_s, 2 * self.tp,
                           self.tp_rank, ((self.engine.url, self.tp),))

    def connect(self) -> None:
        if self.group is not None or not self.sender:
            return
        # The TCP store lives on TP rank 0; everyone needs its port.
        port = [self.master_port or (free_port() if self.poster else 0)]
        if self.tp > 1:
            dist.broadcast_object_list(port, group=self.tp_group, group_src=0)
        posts = []
        if self.poster:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ws-p2p")
            posts.append(self._pool.submit(self.engine.join_group, GroupSpec(
                self.master_address, port[0], self.tp, 2 * self.tp, self.backend, self.timeout_s,
                self.engine.group_name)))
        self._join(posts, lambda: init_custom_process_group(
            self.backend, f"tcp://{self.master_address}:{port[0]}", 2 * self.tp, self.tp_rank,
            self.engine.group_name, self.timeout_s,
        ), [self.engine.url])

    def disconnect(self, seconds: float | None = None) -> None:
        if self.sender:
            self._leave([self.engine] if self.poster else [], self.timeout_s if seconds is None else seconds)

    def open(self, stream) -> None:
        if stream.mode != "per_rank":
            raise ValueError("P2PSink needs a per_rank stream")
        self.stream = stream
        self._begin_update()
        self.connect()

    def _opened(self) -> BucketStream:
        if self.stream is None:
            raise RuntimeError("P2PSink: send before open")
        return self.stream

    def send(self, bucket: Bucket) -> None:
        if not self.sender:
            return
        failure = self._finish_inflight()
        if self.delta is not None and self.delta.active:
            header, payload = self.delta.encode(bucket.index, bucket.buffer, bucket.word)
            bucket = Bucket(bucket.index, payload, bucket.metas, delta=header)
        digest = checksum(bucket.buffer) if self.checksums else None
        digests, headers = [digest] * self.tp, [bucket.delta] * self.tp  # gathered below where they differ
        if (self.checksums or bucket.delta is not None) and self.tp > 1:
            # The TP ranks meet here for every bucket: a failure seen by one (the poster hears the engine)
            # is raised by all, so that none is left waiting in this collective for a rank that stopped.
            everyone: list = [None] * self.tp
            dist.all_gather_object(everyone, (digest, bucket.delta, failure), group=self.tp_group)
            digests, headers = [d for d, _, _ in everyone], [h for _, h, _ in everyone]
            failure = next((f for _, _, f in everyone if f is not None), None)
        if failure is not None:
            raise failure
        posts = []
        if self.poster:
            ranks = []
            for r in range(self.tp):
                metas = bucket.metas if r == self.tp_rank else self._opened().metas_for_rank(bucket.index, r)
                encoded = headers[r]
                nbytes = max((m.offset + m.nbytes for m in metas), default=0) if encoded is None else encoded.nbytes
                ranks.append(RankBucket(r, tuple(metas), nbytes, digests[r] if self.checksums else None, encoded))
            posts.append(self._engine_pool().submit(self.engine.receive_p2p, bucket.index, ranks))
        work = dist.isend(bucket.buffer, group=self.group, group_dst=self.tp + self.tp_rank)
        self._inflight.start(bucket, work, posts)

    def _finish_inflight(self) -> UpdateError | None:
        """Finish the bucket in flight; its failure, kept to raise once the TP ranks have met."""
        try:
            self._inflight.finish()
        except UpdateError as exc:
            return exc
        return None

    def close(self) -> None:
        """Finish the bucket in flight; in a delta update, every TP rank's checksums of its buckets' new bytes go
        to the snapshot of each (``Snapshot.ranks``: what engine rank r must report), the TP ranks meeting
        whether or not one of them failed."""
        if not self.sender:
            return
        if self.delta is None or not self.delta.active:
            self._inflight.finish()
            return
        failure = self._finish_inflight()
        everyone: list = [(self.delta.digests, failure)]
        if self.tp > 1:
            everyone = [None] * self.tp
            dist.all_gather_object(everyone, (self.delta.digests, failure), group=self.tp_group)
        self.delta.ranks = [d for d, _ in everyone]
        failure = next((f for _, f in everyone if f is not None), None)
        if failure is not None:
            raise failure
