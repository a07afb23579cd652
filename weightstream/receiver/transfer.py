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
    """Receiving bucket k + 1 while bucket k is loaded, on a GPU: the two receive buffers ``kept`` (grown to
    ``largest`` bytes where smaller), the loads on a stream of their own, and an event per buffer that the next
    receive into it waits for (on the device, not the host). On a CPU the steps simply run in turn."""

    def __init__(self, kept: ReceiveBuffers, largest: int):
        self.kept = kept
        self.cuda = kept.device.type == "cuda"
        if not self.cuda:
            return
        bufs = kept.buffers
        if len(bufs) != 2 or bufs[0].numel() < largest:
            kept.buffers = [typed_buffer(largest, kept.device) for _ in range(2)]
        if kept.load_stream is None:
            kept.load_stream = torch.cuda.Stream(kept.device)
        self.load_stream = kept.load_stream  # kept across updates
        self.loaded = [torch.cuda.Event(), torch.cuda.Event()]
        self.main = torch.cuda.current_stream(kept.device)

    def receive(self, i: int, nbytes: int, group, src: int | None = None) -> torch.Tensor:
        """Bucket ``i``'s ``nbytes``: broadcast from group rank 0, or sent by group rank ``src``."""
        if not self.cuda:
            raw = typed_buffer(nbytes, self.kept.device)
        else:
            raw = self.kept.buffers[i % 2]
            self.main.wait_event(self.loaded[i % 2])  # bucket i - 2 was loaded out of this buffer
        take(raw.narrow(0, 0, nbytes), group, src)  # after it, on a GPU: this stream has the bytes
        return raw

    @contextmanager
    def loading(self, i: int) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        stream = self.load_stream
        stream.wait_stream(self.main)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            self.loaded[i % 2].record(stream)

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.kept.device)
