"""What an engine rank keeps for delta updates (``docs/delta.md``): per bucket index (a resharded bucket: per bucket
index and trainer rank) the layout and the bytes of the bucket it last applied, to which the next delta is applied,
and the checksum of what the open session applied, for the trainer to compare."""

from __future__ import annotations

import torch

from weightstream.receiver.programs import verify_checksum
from weightstream.streaming.bucket import TensorMeta
from weightstream.streaming.delta import DeltaHeader, Key, apply, warm_kernels
from weightstream.wire.handles import checksum

__all__ = ["HeldDeltas"]


class HeldDeltas:
    """The bytes held for deltas on one rank (``device``), at most ``limit`` bytes in all; ``changed``: the open
    session changed them (an abort leaves them unknown: they are dropped)."""

    def __init__(self, device: torch.device, limit: int):
        self.device, self.limit = device, limit
        self.held: dict[Key, tuple[tuple[TensorMeta, ...], torch.Tensor]] = {}
        self.digests: dict[Key, str] = {}
        self.changed = False
        self.warmed_words: set[int] = set()  # word sizes the delta kernels were compiled for (on a GPU)

    def __len__(self) -> int:
        return len(self.held)

    def begin(self) -> None:
        """A session opens: nothing applied yet."""
        self.digests, self.changed = {}, False

    def forget(self) -> int:
        """Drop every bucket held (the weights were loaded otherwise: they no longer match them); how many."""
        dropped = len(self.held)
        self.held, self.digests = {}, {}
        return dropped

    def abort(self) -> None:
        """The session was rolled back: bytes it changed in place are no longer the committed ones."""
        if self.changed:
            self.forget()

    def new_bytes(self, index: Key, layout: tuple[TensorMeta, ...], total: int, header: DeltaHeader,
                  received: torch.Tensor, expected_checksum: str | None) -> torch.Tensor:
        """Bucket ``index``'s new bytes (``total``, laid out as ``layout``): its payload ``received`` (the changed
        words, or the whole bucket) checked against the sender's checksum where given and applied to the bytes
        held of the bucket; they are kept for the next update, and their checksum for the trainer to compare
        (:meth:`checksums`)."""
        if header.total != total:
            raise ValueError(f"delta bucket {index}: {header.total} bytes, its tensors take {total}")
        payload = received.narrow(0, 0, header.nbytes)
        verify_checksum(payload, expected_checksum, f"delta bucket {index}")
        held = self.held.get(index)
        if header.encoding != "dense" and (held is None or held[0] != layout):
            raise ValueError(f"delta bucket {index}: this engine holds no bytes of that bucket to apply it to "
                             "(a full update must come first)")
        if held is None and sum(b.numel() for _, b in self.held.values()) + total > self.limit:
            raise ValueError(f"delta bucket {index}: the bytes held for deltas would exceed {self.limit} "
                             "(twice the model's size): more buckets than any plan of this model has")
        self.changed = True
        if header.encoding == "dense":
            raw = received
            if header.word not in self.warmed_words:  # the first delta of these words then finds them compiled
                warm_kernels(self.device, (header.word,))
                self.warmed_words.add(header.word)
        else:
            raw = held[1]  # type: ignore[index]  # held is checked above
            apply(raw.narrow(0, 0, header.total), header, payload)
        self.held[index] = (layout, raw)
        self.digests[index] = checksum(raw.narrow(0, 0, header.total))
        return raw

    def checksums(self) -> dict[int, str]:
        """The checksum of each bucket's bytes the open (or last) session applied, by bucket index; a resharded
        bucket's: those of its trainer ranks' parts joined with ``+`` in trainer-rank order (what the trainer's
        ``sinks.reshard.expected_digests`` joins)."""
        whole: dict[int, str] = {}
        parts: dict[int, list[tuple[int, str]]] = {}
        for key, digest in self.digests.items():
            if isinstance(key, tuple):
                parts.setdefault(key[0], []).append((key[1], digest))
            else:
                whole[key] = digest
        return {**whole, **{i: "+".join(d for _, d in sorted(ps)) for i, ps in parts.items()}}
