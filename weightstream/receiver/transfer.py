"""Bytes off a weight-update group into an engine rank: one tensor broadcast from group rank 0 or sent by one rank,
a delta bucket's header and payload, and the pipeline that receives bucket k + 1 while bucket k is loaded (on a GPU,
into two buffers kept across updates)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from weightstream.streaming.bucket import typed_buffer
from weightstream.streaming.delta import DeltaHeader

__all__ = ["take", "receive_header", "receive_payload", "ReceiveBuffers", "Pipeline"]


def take(tensor: torch.Tensor, group, src: int | None) -> None:
    """``tensor`` filled from the wire: broadcast from group rank 0 (``src`` None), or sent by group rank ``src``."""
    if src is None:
        dist.broadcast(tensor, group=group, group_src=0)
    else:
        dist.recv(tensor, group=group, group_src=src)


def receive_payload(group, header: DeltaHeader, src: int | None, device: torch.device) -> torch.Tensor:
    """A delta bucket's payload (``header.nbytes``), broadcast (or sent by group rank ``src``) into a buffer of ours
    (that views as any dtype)."""
    raw = typed_buffer(header.nbytes, device)
    take(raw.narrow(0, 0, header.nbytes), group, src)
    return raw


def receive_header(group, words: torch.Tensor, src: int | None, total: int, limit: int, index: int) -> DeltaHeader:
    """Bucket ``index``'s delta header, read off the wire before its payload (``words``: a buffer of
    :data:`~weightstream.streaming.delta.HEADER_WORDS`; ``src`` as :func:`take`), for ``total`` bucket bytes and a
    payload of at most ``limit``; raises where it cannot be (every field named) or is another bucket's."""
    take(words, group, src)
    header, got = DeltaHeader.from_words(words.tolist(), total, limit)
    if got != index:
        raise ValueError(f"bucket {index} of the update came with the delta header of bucket {got}")
    return header


class ReceiveBuffers:
    """What an engine rank keeps across updates for receiving on a GPU: two receive buffers and the stream the loads
    out of them run on (made on first use; the buffers dropped when memory is released)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor] = []
        self.load_stream: torch.cuda.Stream | None = None

    def clear(self) -> None:
        self.buffers = []


class Pipeline:
    """Receiving bucket k + 1 while bucket k is loaded, on a GPU: the two receive buffers ``kept`` (grown to the
    largest of ``wire``'s bytes where smaller), the loads on a stream of their own, and an event per buffer that the
    next receive into it waits for (on the device, not the host). ``wire``: each bucket's bytes and the group rank that
    sends it (None: broadcast from rank 0), in order. Bucket k + 1's receive is queued before bucket k is handed out
    to be loaded, so the wire carries it while the host checks and queues bucket k's loads (any wait on bucket k's
    values then waits for bucket k's bytes alone: an event marks each receive's end). On a CPU the steps simply run
    in turn."""

    def __init__(self, kept: ReceiveBuffers, wire: list[tuple[int, int | None]], group):
        self.kept = kept
        self.wire = wire
        self.group = group
        self.cuda = kept.device.type == "cuda"
        self.posted = -1  # the last bucket whose receive is queued
        if not self.cuda:
            return
        largest = max((n for n, _ in wire), default=0)
        bufs = kept.buffers
        if len(bufs) != 2 or bufs[0].numel() < largest:
            kept.buffers = [typed_buffer(largest, kept.device) for _ in range(2)]
        if kept.load_stream is None:
            kept.load_stream = torch.cuda.Stream(kept.device)
        self.load_stream = kept.load_stream  # kept across updates
        self.loaded = [torch.cuda.Event(), torch.cuda.Event()]
        self.received = [torch.cuda.Event(), torch.cuda.Event()]
        self.main = torch.cuda.current_stream(kept.device)

    def receive(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s bytes (in order: bucket ``i - 1`` was received before); on a GPU, bucket ``i + 1``'s receive
        queued behind them."""
        if not self.cuda:
            nbytes, src = self.wire[i]
            raw = typed_buffer(nbytes, self.kept.device)
            take(raw.narrow(0, 0, nbytes), self.group, src)
            return raw
        while self.posted < min(i + 1, len(self.wire) - 1):
            self._post(self.posted + 1)
        return self.kept.buffers[i % 2]

    def _post(self, k: int) -> None:
        nbytes, src = self.wire[k]
        raw = self.kept.buffers[k % 2]
        self.main.wait_event(self.loaded[k % 2])  # bucket k - 2 was loaded out of this buffer
        take(raw.narrow(0, 0, nbytes), self.group, src)  # after it, on a GPU: this stream has the bytes
        self.received[k % 2].record(self.main)
        self.posted = k

    @contextmanager
    def loading(self, i: int) -> Iterator[None]:
        """Bucket ``i``'s loads (and checks), on the load stream after its bytes (not the next bucket's) are in."""
        if not self.cuda:
            yield
            return
        stream = self.load_stream
        stream.wait_event(self.received[i % 2])
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            self.loaded[i % 2].record(stream)

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.kept.device)
