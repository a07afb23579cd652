"""``IPCSink``: colocated delivery. Trainer rank r and engine TP rank r share a device; each bucket's
flat buffer crosses as a CUDA IPC handle (by GPU UUID) or, on the CPU, as a shared-memory file.
The trainer keeps the buffer alive until the engine says it has loaded it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from weightstream.errors import UpdateError
from weightstream.streaming.adapters.base import EngineAdapter
from weightstream.streaming.bucket import Bucket
from weightstream.streaming.serialization import checksum


class IPCSink:
    name = "ipc"

    def __init__(self, engine: EngineAdapter, *, checksums: bool = False):
        self.engine = engine
        self.checksums = checksums
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.engine_tp = 1

    def open(self, stream) -> None:
        if stream.mode != "full":
            raise ValueError("IPCSink sends whole tensors: it needs a full stream")
        info = [self.engine.info().tp_size if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(info, group_src=0)
        self.engine_tp = int(info[0])
        if self.engine_tp > self.world:
            raise ValueError(f"engine TP {self.engine_tp} needs as many colocated trainer ranks; the job has {self.world}")

    def send(self, bucket: Bucket) -> None:
        if bucket.buffer.is_cuda:
            # The engine reads the buffer from another process, outside this stream's order.
            torch.cuda.current_stream(bucket.buffer.device).synchronize()
        mine: Any = None
        if self.rank < self.engine_tp:
            mine = (self.engine.encode_ipc(bucket), checksum(bucket.buffer) if self.checksums else None)
        everyone = [mine]
        if self.world > 1:
            everyone = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, everyone, group_dst=0)
        status: list[Any] = [None]
        if self.rank == 0:
            try:
                payloads = [p for p, _ in everyone[: self.engine_tp]]
                digests = [d for _, d in everyone[: self.engine_tp]] if self.checksums else None
                self.engine.receive_ipc(bucket.index, payloads, digests)
            except Exception as exc:  # noqa: BLE001 — shared with the other ranks below
                status[0] = UpdateError(f"bucket {bucket.index}", str(exc), [self.engine.url])
        if self.world > 1:
            # Every rank holds its buffer until the engine has loaded it.
            dist.broadcast_object_list(status, group_src=0)
        if status[0] is not None:
            raise status[0]

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass
