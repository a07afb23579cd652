"""``BroadcastSink``: one broadcast of each bucket's flat buffer from the trainer's sender rank to
every rank of every engine, through a process group made outside the default world (NCCL on GPUs,
gloo on CPUs). The bucket metadata goes to each engine over HTTP concurrently, and the next bucket
is packed while this one is on the wire."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from weightstream.common.bounds import Deadline
from weightstream.common.processes import free_port
from weightstream.engines.base import (
    BROADCAST,
    BROADCAST_AHEAD,
    BROADCAST_PREPARE,
    BroadcastAheadEngine,
    BroadcastEngine,
    BroadcastPrepareEngine,
    EngineAdapter,
    GroupSpec,
    capable,
    implementing,
)
from weightstream.errors import UpdateError
from weightstream.sinks.base import Delivery
from weightstream.sinks.pipelined import InFlight, PipelinedSink, Sends, deltas_ahead, future_errors, header_tensor
from weightstream.streaming.bucket import Bucket
from weightstream.streaming.delta import Snapshot
from weightstream.wire.groups import WARM_BROADCAST, GroupLayout, init_custom_process_group
from weightstream.wire.handles import checksum

if TYPE_CHECKING:
    from weightstream.streaming.stream import BucketStream

__all__ = ["default_backend", "BroadcastSink"]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _is_sender() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class BroadcastSink(PipelinedSink):
    name = "broadcast"

    def __init__(self, engines: Sequence[EngineAdapter], *, master_address: str = "127.0.0.1",
                 master_port: int | None = None, backend: str | None = None, timeout_s: float = 60.0,
                 checksums: bool = False, ahead: bool = True, delta: Snapshot | None = None):
        """``delta``: the sender's snapshot of the bytes the engines hold; each bucket then goes out as it
        encodes it (:meth:`Snapshot.encode`; every engine must declare ``delta``), with its metadata per bucket."""
        self.engines = [implementing(e, BROADCAST, BroadcastEngine) for e in engines]
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend or default_backend()
        self.timeout_s = timeout_s
        self.checksums = checksums
        self.ahead = ahead  # where every engine takes it, the metadata of all buckets goes in one request
        self.group = None
        self.sender = _is_sender()
        self._pool: ThreadPoolExecutor | None = None
        self._inflight = InFlight(timeout_s, [e.url for e in self.engines])
        self.ahead_used = False  # the last update sent every bucket's metadata ahead
        self._ahead: list = []  # the engines' replies to the metadata of every bucket, sent ahead
        self.delta = delta

    # -- group lifetime (separate steps: connect once, update many times) ------------------------

    def _ranks(self) -> tuple[list[int], int]:
        """Each engine's first rank in the group, and the group's size (the sender is rank 0)."""
        offsets, world = [], 1
        for e in self.engines:
            offsets.append(world)
            world += e.info().tp_size
        return offsets, world

    def layout(self) -> GroupLayout | None:
        if not self.sender:
            return None
        offsets, world = self._ranks()
        return GroupLayout(self.master_address, self.backend, self.engines[0].group_name, self.timeout_s, world, 0,
                           tuple((e.url, off) for e, off in zip(self.engines, offsets, strict=True)))

    def connect(self) -> None:
        if not self.sender or self.group is not None:
            return
        port = self.master_port or free_port()
        offsets, world = self._ranks()
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.engines)), thread_name_prefix="ws-broadcast")
        warm = self._warming(self.engines, WARM_BROADCAST)
        posts = [
            self._pool.submit(e.join_group, GroupSpec(self.master_address, port, off, world, self.backend,
                                                      self.timeout_s, e.group_name, warm))
            for e, off in zip(self.engines, offsets, strict=True)
        ]
        self._join(posts, lambda: self._form(lambda: init_custom_process_group(
            self.backend, f"tcp://{self.master_address}:{port}", world, 0, self.engines[0].group_name, self.timeout_s,
        ), warm), [e.url for e in self.engines])

    def disconnect(self, seconds: float | None = None) -> None:
        if self.sender:
            self._leave(self.engines, self.timeout_s if seconds is None else seconds)

    def prepare(self, stream: BucketStream) -> None:
        """Where every engine takes a broadcast plan ahead of any update (:data:`BROADCAST_PREPARE`) and the buckets
        would go ahead: every bucket's metadata to each now, whose ranks make their loads of them ready; the first
        update then sends the plan's key alone and loads as a later one does. Bounded by the sink's timeout."""
        if not self.sender or self.checksums or not self.ahead or not len(stream):
            return
        ready = [a for e in self.engines if (a := capable(e, BROADCAST_PREPARE, BroadcastPrepareEngine)) is not None]
        if len(ready) != len(self.engines):
            return
        metas = [stream.bucket_metas(i) for i in range(len(stream))]
        bound = self.timeout_s * (1 + len(metas) / 8)
        pool = ThreadPoolExecutor(max_workers=len(ready), thread_name_prefix="weightstream-prepare")
        posts = [pool.submit(e.prepare_broadcast_ahead, metas, stream.metadata_digest(), bound) for e in ready]
        problems = future_errors(posts, Deadline(bound + 2.0))
        pool.shutdown(wait=False, cancel_futures=True)
        if problems:
            raise UpdateError("prepare", " | ".join(problems), [e.url for e in self.engines])

    # -- per update ------------------------------------------------------------------------------

    def open(self, stream: BucketStream) -> None:
        """Connect; where every engine takes the metadata of all buckets ahead (and no per-bucket checksum
        is asked for; in a delta-mode update, where every engine takes its deltas so too: ``delta_ahead``), send it
        now: the buckets then go on the wire back to back (each delta payload behind its header)."""
        self._begin_update()
        self.connect()
        self._ahead = []
        self.ahead_used = False
        delta = self.delta is not None and self.delta.active
        if not self.sender or self.checksums or not self.ahead or not len(stream) or (
                delta and not deltas_ahead(self.engines)):
            return
        ahead = [a for e in self.engines if (a := capable(e, BROADCAST_AHEAD, BroadcastAheadEngine)) is not None]
        if len(ahead) == len(self.engines):
            metas = [stream.bucket_metas(i) for i in range(len(stream))]
            digest = stream.metadata_digest()
            self._post_ahead([partial(e.receive_broadcast_ahead, metas, delta=delta, digest=digest) for e in ahead],
                             len(metas))
            self.ahead_used = True

    def delivery(self) -> Delivery:
        return Delivery(metadata_ahead=self.ahead_used, formed_group=self.formed > self._formed_before)

    def send(self, bucket: Bucket) -> None:
        if not self.sender:
            return
        self._finish_ahead(every=False)
        if self.delta is not None and self.delta.active:
            header, payload = self.delta.encode(bucket.index, bucket.buffer, bucket.word)
            bucket = Bucket(bucket.index, payload, bucket.metas, delta=header)
        digest = checksum(bucket.buffer) if self.checksums else None
        posts = [] if self._ahead else [self._engine_pool().submit(e.receive_broadcast, bucket, digest)
                                        for e in self.engines]
        buffers = [bucket.buffer]
        if self._ahead and bucket.delta is not None:  # its header goes first, on the wire (delta_ahead)
            buffers.insert(0, header_tensor(bucket.delta, bucket.index, bucket.buffer.device))
        works = [dist.broadcast(b, group=self.group, group_src=0, async_op=True) for b in buffers]
        self._inflight.start(bucket, Sends(works, buffers, self.backend), posts)

    def close(self) -> None:
        if not self.sender:
            return
        self._finish_ahead()
        self._close_ahead([e.url for e in self.engines])
