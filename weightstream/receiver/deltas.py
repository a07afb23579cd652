"""What an engine rank keeps for delta updates (``docs/delta.md``): per bucket index (a resharded bucket: per bucket
index and trainer rank) the layout and the bytes of the bucket it last applied, to which the next delta is applied,
the checksum of what the open session applied, for the trainer to compare, and the committed update those bytes are.

Every engine that takes deltas keeps one :class:`HeldDeltas` per rank: the reference engine's worker, the vLLM
plugin's weight-transfer engine (one per vLLM worker) and the SGLang loader (one per TP rank's process)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import torch

from weightstream.common.layout import ALIGN
from weightstream.receiver.programs import verify_checksum
from weightstream.streaming.bucket import TensorMeta
from weightstream.streaming.delta import DeltaHeader, Key, apply, warm_kernels
from weightstream.wire.handles import checksum

__all__ = ["HeldDeltas", "held_limit"]


def held_limit(parameters: Iterable[torch.Tensor], ranks: int) -> int:
    """At most what one rank may hold for deltas where every rank is sent every tensor whole while its model holds
    a part of most (``parameters``: this rank's, ``ranks``: how many share the model): twice the whole model, each
    tensor padded to the buckets' alignment. The vLLM plugin and the SGLang loader bound their bytes so."""
    return 2 * ranks * sum(p.numel() * p.element_size() + ALIGN for p in parameters)


class HeldDeltas:
    """The bytes one engine rank holds for deltas, at most ``limit`` bytes in all (None until the engine knows its
    model: :meth:`new_bytes` refuses until it is set), and what they are.

    ``instance`` names this rank's life (a restarted engine names another); ``version`` is the committed update whose
    bytes these are, where the rank names it (None: none; the trainer then sends a full update; the reference
    engine names it in its server); ``changed``: the open session changed the bytes and no commit has settled them
    yet; ``plain``: the open session loaded a bucket whole.

    The order an engine calls them in: :meth:`begin` when a session opens; per bucket, :meth:`new_bytes` (a delta
    bucket) or :meth:`loaded_whole` (a bucket sent whole, in an engine that cannot roll back); :meth:`checksums`
    when the trainer asks what the session applied; then :meth:`commit` once the engine committed the session, or
    :meth:`abort` once it rolled it back (a session left without either, as by a trainer that went away, is aborted
    by the next :meth:`begin`); :meth:`forget` whenever the weights were loaded otherwise."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.instance = uuid.uuid4().hex[:16]
        self.version: str | None = None
        self.held: dict[Key, tuple[tuple[TensorMeta, ...], torch.Tensor]] = {}
        self.digests: dict[Key, str] = {}
        self.changed = False
        self.plain = False
        self.warmed: set[tuple[torch.device, int]] = set()  # the devices and word sizes the kernels were readied for

    def __len__(self) -> int:
        return len(self.held)

    @property
    def nbytes(self) -> int:
        """The bytes held, over every bucket."""
        return sum(raw.numel() for _, raw in self.held.values())

    def begin(self) -> None:
        """Caller: the engine when an update session opens, before its first bucket: nothing applied yet. Bytes that
        the last session changed and no commit settled are dropped (:meth:`abort`: a full update comes)."""
        self.abort()
        self.digests, self.changed, self.plain = {}, False, False

    def new_bytes(self, index: Key, layout: tuple[TensorMeta, ...], total: int, header: DeltaHeader,
                  received: torch.Tensor, expected_checksum: str | None) -> torch.Tensor:
        """Caller: the engine for each delta bucket of the open session, after :meth:`begin` and before the bucket is
        loaded. Bucket ``index``'s new bytes (``total``, laid out as ``layout``): its payload ``received`` (the
        changed words, or the whole bucket) checked against the sender's checksum where given and applied to the
        bytes held of the bucket; they are kept for the next update, and their checksum for the trainer to compare
        (:meth:`checksums`). No committed update names the held bytes until :meth:`commit`. Raises ``ValueError``
        where there is nothing to apply a delta to or the bytes would exceed ``limit``."""
        if self.limit is None:
            raise RuntimeError(f"delta bucket {index}: no bound is set on the bytes held for deltas")
        if header.total != total:
            raise ValueError(f"delta bucket {index}: {header.total} bytes, its tensors take {total}")
        payload = received.narrow(0, 0, header.nbytes)
        verify_checksum(payload, expected_checksum, f"delta bucket {index}")
        held = self.held.get(index)
        if header.encoding != "dense" and (held is None or held[0] != layout):
            raise ValueError(f"delta bucket {index}: this engine holds no bytes of that bucket to apply it to "
                             "(a full update must come first)")
        if held is None and self.nbytes + total > self.limit:
            raise ValueError(f"delta bucket {index}: the bytes held for deltas would exceed {self.limit} "
                             "(twice the model's size): more buckets than any plan of this model has")
        self.changed, self.version = True, None
        if header.encoding == "dense":
            raw = received
            if (received.device, header.word) not in self.warmed:  # the first delta of these words finds them ready
                warm_kernels(received.device, (header.word,))
                self.warmed.add((received.device, header.word))
        else:
            raw = held[1]  # type: ignore[index]  # held is checked above
            apply(raw.narrow(0, 0, header.total), header, payload)
        self.held[index] = (layout, raw)
        self.digests[index] = checksum(raw.narrow(0, 0, header.total))
        return raw

    def loaded_whole(self) -> None:
        """Caller: an engine that cannot roll back (the vLLM plugin, the SGLang loader) for each bucket of the open
        session sent whole, before loading it: the weights no longer match what is held, which is dropped, and the
        session's :meth:`commit` names no version."""
        self.forget()
        self.plain = True

    def checksums(self) -> dict[int, str]:
        """Caller: the engine when the trainer asks, after the session's buckets (before or after :meth:`commit`).
        The checksum of each bucket's bytes the open (or last) session applied, by bucket index; a resharded
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

    def commit(self, version: str | None) -> None:
        """Caller: the engine once it committed the open session, after its last bucket. The bytes the session
        changed are settled: kept for the next update, as ``version``'s where the session applied delta buckets only
        (None: the engine names its versions elsewhere, as the reference engine's server does); a session that loaded
        a bucket whole leaves nothing held and no version. A session that failed or was aborted is never committed,
        so the next :meth:`begin` drops what it changed."""
        if self.plain:
            self.forget()
        elif self.changed:
            self.version = version or None
        self.changed = False

    def abort(self) -> None:
        """Caller: the engine once it rolled the open session back (and :meth:`begin`, for a session neither
        committed nor rolled back): bytes it changed in place are no longer the committed ones, so all are dropped."""
        if self.changed:
            self.forget()

    def forget(self) -> int:
        """Caller: the engine whenever its weights were loaded otherwise (the reference engine at the commit of a
        session that loaded buckets whole): every bucket held is dropped, with the session's checksums and the
        version; how many buckets."""
        dropped = len(self.held)
        self.held, self.digests, self.version = {}, {}, None
        return dropped
