"""Delta updates: a bucket sent as the words that changed since the bytes the engine holds, bit-exact.

A bucket's bytes are compared with the sender's snapshot of what the engine last committed, word by word (the
word is the narrowest element size of the bucket's tensors: 2 bytes for bf16, 1 for float8), and the changed
words go out in the smallest of the encodings below; a bucket where too much changed goes out dense. The
engine applies the payload to the bytes it holds and gets exactly the new ones: only words the sender read as
changed are written, with the sender's values. Measured on real optimizer steps (``docs/engines.md``):

- ``indices``: the changed words' positions (int32) then their values: ``count * (4 + word)`` bytes;
- ``bitmap``: one bit per word (set: changed) then the changed words' values: ``ceil(words / 8) + count *
  word`` bytes; smaller than ``indices`` once more than one word in 32 (bf16) changed;
- ``dense``: the bucket's bytes as they are.

Pure functions of tensors; they run where the tensors live (the GPU, or the CPU)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor

from weightstream.common import word_kernels
from weightstream.wire.handles import checksum

__all__ = [
    "Encoding", "ENCODINGS", "INDEX_BYTES", "HEADER_WORDS", "Key", "DeltaHeader", "header_problems", "word_size",
    "encoded_bytes", "choose", "encode", "encode_into", "warm_kernels", "apply", "Snapshot"
]


Encoding = Literal["dense", "indices", "bitmap"]
ENCODINGS: tuple[Encoding, ...] = ("dense", "indices", "bitmap")
INDEX_BYTES = 4  # a changed word's position in ``indices`` (int32: buckets up to 2**31 words)
HEADER_WORDS = 6  # a header on the wire (:meth:`DeltaHeader.as_words`): encoding, word, total, count, nbytes, index
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_GATHER = 0x0102040810204080  # byte k of an int64 times this: into bit 56 + k (see _pack_bits)
_ADD = 0x0101010101010101  # an int64 of 8 bytes times this: their sum in the top byte (see _count)
# What a snapshot keeps bytes under: a bucket's index, or (resharded P2P) the bucket's index and the engine rank
# that the bytes go to (one sender sends one bucket to several engine ranks, each its own bytes).
Key = int | tuple[int, int]


@dataclass(frozen=True, slots=True)
class DeltaHeader:
    """How one bucket's payload is encoded: ``total`` bucket bytes compared in words of ``word`` bytes, of which
    ``count`` changed, sent in ``nbytes`` bytes as ``encoding``."""

    encoding: Encoding
    word: int
    total: int
    count: int
    nbytes: int

    @property
    def words(self) -> int:
        return self.total // self.word

    def as_json(self) -> dict:
        return {"encoding": self.encoding, "word": self.word, "total": self.total, "count": self.count,
                "nbytes": self.nbytes}

    def as_words(self, index: int) -> list[int]:
        """The header of bucket ``index`` as :data:`HEADER_WORDS` integers, as it crosses the wire ahead of its
        payload where the bucket's metadata went ahead (:meth:`from_words` reads it)."""
        return [ENCODINGS.index(self.encoding), self.word, self.total, self.count, self.nbytes, index]

    @classmethod
    def from_words(cls, words: Sequence[int], total: int, limit: int) -> tuple[DeltaHeader, int]:
        """The header and the bucket index :meth:`as_words` wrote, for a bucket of ``total`` bytes whose payload
        takes at most ``limit``; raises ``ValueError`` listing every field that cannot be (:func:`header_problems`)."""
        code, word, got_total, count, nbytes, index = (int(w) for w in words)
        encoding = ENCODINGS[code] if 0 <= code < len(ENCODINGS) else None
        problems = [] if encoding is not None else [
            f"encoding {code} is none of {list(range(len(ENCODINGS)))} ({', '.join(ENCODINGS)})"]
        problems += header_problems(encoding, word, got_total, count, nbytes, bucket_bytes=total, limit=limit)
        if problems:
            raise ValueError(f"bad delta header for bucket {index}: " + "; ".join(problems))
        assert encoding is not None
        return cls(encoding, word, total, count, nbytes), index

    @classmethod
    def from_request(cls, d: Mapping[str, Any], total: int, limit: int) -> tuple[DeltaHeader, int]:
        """The header and the bucket index a per-bucket request carries (:meth:`as_json` and ``index``; its fields'
        types checked by the receiver first: ``receiver.schema.delta_problems``), for a bucket of ``total``
        bytes whose payload takes at most ``limit``: checked as :meth:`from_words` checks a header sent ahead (by
        :func:`header_problems`), raising ``ValueError`` listing every field that cannot be."""
        index = int(d["index"])
        encoding = d["encoding"] if d["encoding"] in ENCODINGS else None
        problems = [] if encoding is not None else [
            f"encoding {str(d['encoding'])[:40]!r} is none of {list(ENCODINGS)}"]
        problems += header_problems(encoding, int(d["word"]), int(d["total"]), int(d["count"]), int(d["nbytes"]),
                                    bucket_bytes=total, limit=limit)
        if problems:
            raise ValueError(f"bad delta header for bucket {index}: " + "; ".join(problems))
        return cls(cast(Encoding, encoding), int(d["word"]), total, int(d["count"]), int(d["nbytes"])), index

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DeltaHeader:
        """The header :meth:`as_json` wrote (other keys, such as the bucket's index, ignored), as it is: a receiver
        that applies it reads it with :meth:`from_request`, which checks it against the bucket."""
        return cls(cast(Encoding, d["encoding"]), int(d["word"]), int(d["total"]), int(d["count"]), int(d["nbytes"]))


def header_problems(encoding: Encoding | None, word: int, total: int, count: int, nbytes: int, *, bucket_bytes: int,
                    limit: int) -> list[str]:
    """What makes a delta header unfit for a bucket of ``bucket_bytes`` whose payload may take at most ``limit``
    bytes (``encoding`` None: not one of :data:`ENCODINGS`, which the caller names): every problem, none where
    the header describes exactly a payload that :func:`apply` turns into the bucket's ``bucket_bytes`` bytes. The
    one check of a header, whether it crossed the wire ahead of its payload or came with a per-bucket request."""
    problems = []
    if word not in _WORD_DTYPES:
        problems.append(f"word of {word} bytes (1, 2 or 4)")
    if total != bucket_bytes:
        problems.append(f"{total} bucket bytes, its tensors take {bucket_bytes}")
    if not 0 <= nbytes <= limit:
        problems.append(f"a payload of {nbytes} bytes (at most {limit})")
    if problems or encoding is None:
        return problems
    if total % word:
        problems.append(f"words of {word} bytes do not divide the bucket's {total} bytes")
    elif not 0 <= count <= total // word:
        problems.append(f"{count} changed words of {total // word}")
    elif nbytes != encoded_bytes(encoding, total // word, count, word):
        problems.append(f"{nbytes} payload bytes, {encoding} of {count} words takes "
                        f"{encoded_bytes(encoding, total // word, count, word)}")
    return problems


def word_size(total: int, itemsizes: Iterable[int]) -> int:
    """The word a bucket of ``total`` bytes holding elements of ``itemsizes`` is compared in: the narrowest
    element (at most 4 bytes), or 1 where ``total`` is not a multiple of it."""
    word = min([4, *itemsizes])
    return word if total % word == 0 else 1


def encoded_bytes(encoding: Encoding, words: int, count: int, word: int) -> int:
    """The payload's size in bytes, known before encoding: what :func:`choose` compares."""
    if encoding == "dense":
        return words * word
    if encoding == "indices":
        return count * (INDEX_BYTES + word)
    return (words + 7) // 8 + count * word


def choose(words: int, count: int, word: int, allowed: Iterable[Encoding] = ENCODINGS) -> Encoding:
    """The smallest of the ``allowed`` encodings (dense wins ties: nothing to decode)."""
    options: list[Encoding] = ["dense", *(e for e in allowed if e != "dense")]
    return min(options, key=lambda e: (encoded_bytes(e, words, count, word), e != "dense"))


def _words(raw: Tensor, word: int) -> Tensor:
    return raw.view(_WORD_DTYPES[word])


def _pack_bits(mask: Tensor) -> Tensor:
    """``mask`` (bool, one per word) as bytes, bit ``i % 8`` of byte ``i // 8`` for word ``i``: each 8 flags (bytes
    0 or 1) read as one little-endian int64, whose product with :data:`_GATHER` carries flag ``k`` to bit ``56 +
    k`` (no two partial products meet in one bit): one pass, no per-bit arithmetic."""
    pad = (-mask.numel()) % 8
    if pad:
        mask = torch.cat([mask, mask.new_zeros(pad)])
    flags = mask.view(torch.uint8).view(torch.int64)
    return ((flags * _GATHER) >> 56).to(torch.uint8)


def _count(mask: Tensor) -> int:
    """How many of ``mask`` (bool) are set: 8 flags at a time read as one int64, whose product with
    ``0x0101010101010101`` sums its 8 bytes into the top one (at most 8: no carry), then one sum (a bool sum widens
    every flag first)."""
    whole = mask.numel() - mask.numel() % 8
    head = mask.narrow(0, 0, whole)
    if whole and head.storage_offset() % 8 == 0:
        flags = head.view(torch.uint8).view(torch.int64)
        count = int(((flags * _ADD) >> 56).sum().item())
    else:
        count, whole = 0, 0
    return count + int(mask.narrow(0, whole, mask.numel() - whole).sum().item())


def _unpack_bits(packed: Tensor, words: int) -> Tensor:
    bits = _BITS.to(packed.device)
    return (packed.unsqueeze(1) & bits).ne(0).view(-1)[:words]


def _same_bucket(new: Tensor, held: Tensor) -> None:
    if new.numel() != held.numel():
        raise ValueError(f"a delta needs the held bytes of the same bucket: {new.numel()} new bytes, "
                         f"{held.numel()} held")


def encode(new: Tensor, held: Tensor, word: int, allowed: Iterable[Encoding] = ENCODINGS,
           ) -> tuple[DeltaHeader, Tensor]:
    """``new``'s bytes (flat uint8) against ``held`` (the bytes the engine holds, same size): the header and the
    payload (flat uint8; ``new`` itself where dense is smallest). Neither input is changed."""
    _same_bucket(new, held)
    total = new.numel()
    a, b = _words(new, word), _words(held, word)
    mask = a != b
    count = _count(mask)
    encoding = choose(a.numel(), count, word, allowed)
    header = DeltaHeader(encoding, word, total, count, encoded_bytes(encoding, a.numel(), count, word))
    if encoding == "dense":
        return header, new
    values = a[mask].view(torch.uint8)
    if encoding == "indices":
        where = mask.nonzero().view(-1).to(torch.int32).view(torch.uint8)
    else:
        where = _pack_bits(mask)
    return header, torch.cat([where, values])


def encode_into(new: Tensor, held: Tensor, word: int, allowed: Iterable[Encoding] = ENCODINGS,
                ) -> tuple[DeltaHeader, Tensor]:
    """:func:`encode`, after which ``held`` holds ``new``'s bytes. Where both are on one CUDA device with the word
    kernels: one pass compares, counts, makes the bitmap and writes the changed words into ``held``, and one more
    packs the changed words (and their positions); the same header and payload, bit for bit."""
    if not (new.device == held.device and word_kernels.available(new.device)):
        header, payload = encode(new, held, word, allowed)
        held.copy_(new)
        return header, payload
    _same_bucket(new, held)
    a = _words(new, word)
    count, bitmap, counts = word_kernels.compare_pack(a, _words(held, word))
    encoding = choose(a.numel(), count, word, allowed)
    header = DeltaHeader(encoding, word, new.numel(), count, encoded_bytes(encoding, a.numel(), count, word))
    if encoding == "dense":
        return header, new
    payload = torch.empty(header.nbytes, dtype=torch.uint8, device=new.device)
    split = count * INDEX_BYTES if encoding == "indices" else bitmap.numel()
    tail = payload.narrow(0, split, count * word)
    values = tail if split % word == 0 else torch.empty(count * word, dtype=torch.uint8, device=new.device)
    positions = payload.narrow(0, 0, split).view(torch.int32) if encoding == "indices" else None
    if encoding == "bitmap":
        payload.narrow(0, 0, split).copy_(bitmap)
    word_kernels.compact(a, bitmap, counts, _words(values, word), positions)
    if values is not tail:  # a bitmap of an odd length: the values start unaligned
        tail.copy_(values)
    return header, payload


def warm_kernels(device: torch.device, words: Iterable[int] = (2,)) -> None:
    """Compile the word kernels on ``device`` before the first delta needs them (each first launch costs about
    2.4 s in all on an H100): per word size, an encoding as positions and one as a bitmap, both applied, and a
    checksum. Nothing where the kernels are not used."""
    if not word_kernels.available(device):
        return
    n = 1 << 14  # words; a multiple of 16, as a bucket's count usually is (Triton compiles per such property)
    for word in words:
        held = torch.zeros(n * word, dtype=torch.uint8, device=device)
        for changed in (1, n // 2):  # few words (positions + values), then many (a bitmap + values)
            new = held.clone()
            new.view(_WORD_DTYPES[word])[:changed] = 1
            header, payload = encode_into(new, held.clone(), word)
            apply(held.clone(), header, payload)
        word_kernels.checksum_sums(held.view(torch.int32))


def apply(held: Tensor, header: DeltaHeader, payload: Tensor) -> Tensor:
    """Write ``payload`` (encoded by :func:`encode` against bytes equal to ``held``) into ``held`` (flat uint8,
    changed in place) and return it: then exactly the sender's new bytes. Raises ``ValueError`` where the
    payload does not fit the header or the held bytes."""
    problems = []
    if held.numel() != header.total:
        problems.append(f"the held bucket has {held.numel()} bytes, the delta is of {header.total}")
    if payload.numel() < header.nbytes:
        problems.append(f"the payload has {payload.numel()} bytes, the header says {header.nbytes}")
    if header.word not in _WORD_DTYPES or header.total % header.word:
        problems.append(f"word {header.word} does not divide the bucket's {header.total} bytes")
    if problems:
        raise ValueError("delta does not fit: " + "; ".join(problems))
    payload = payload.narrow(0, 0, header.nbytes)
    if header.encoding == "dense":
        return held.copy_(payload)
    words = _words(held, header.word)
    split = header.count * INDEX_BYTES if header.encoding == "indices" else (header.words + 7) // 8
    raw_values = payload.narrow(0, split, header.nbytes - split)
    if raw_values.storage_offset() % header.word:  # a bitmap of an odd length: the values start unaligned
        raw_values = raw_values.clone()
    values = _words(raw_values, header.word)
    if header.encoding == "indices":
        where = payload.narrow(0, 0, split).view(torch.int32).long()
        if where.numel() and (int(where.min()) < 0 or int(where.max()) >= words.numel()):
            raise ValueError(f"delta does not fit: positions outside the bucket's {words.numel()} words")
        words[where] = values
    elif word_kernels.available(held.device) and payload.device == held.device:
        packed = payload.narrow(0, 0, split)
        counts = word_kernels.flagged(packed, header.words)
        set_bits = int(counts.sum().item())
        if set_bits != values.numel():
            raise ValueError(f"delta does not fit: {set_bits} bits set for {values.numel()} values")
        word_kernels.expand_into(words, packed, values, counts)
    else:
        mask = _unpack_bits(payload.narrow(0, 0, split), header.words)
        set_bits = _count(mask)
        if set_bits != values.numel():
            raise ValueError(f"delta does not fit: {set_bits} bits set for {values.numel()} values")
        words[mask] = values
    return held


class Snapshot:
    """The sender's copy of the bytes the engine holds, per bucket index: kept on the buckets' device
    (``"device"``: one bucket-sized copy each, compared where the bucket is) or in host memory (``"host"``,
    pinned where CUDA is present: the bucket is compared on the host). Costs one byte per byte of weights
    sent (2 GB per billion bf16 parameters).

    Per update: :meth:`begin` (``full``: every bucket dense, the snapshot made anew; ``active`` False: this
    update's buckets go as they are, not through the snapshot), :meth:`encode` per bucket (the snapshot takes
    the new bytes), and :attr:`digests` the checksum of each bucket's new bytes, to compare with what the
    engine reports. :meth:`forget` after anything that leaves the engine's bytes unknown (a failed update):
    the next must be full."""

    def __init__(self, where: str = "device", allowed: Iterable[Encoding] = ENCODINGS):
        if where not in ("device", "host"):
            raise ValueError(f"snapshot must be kept on 'device' or 'host', got {where!r}")
        self.where = where
        self.allowed = tuple(allowed)
        self.held: dict[Key, Tensor] = {}
        self.full = True
        self.active = False  # the buckets of the update under way go through :meth:`encode`
        self.digests: dict[Key, str] = {}
        self.headers: dict[Key, DeltaHeader] = {}
        # per-rank senders (P2P, IPC, resharded): per engine URL, the checksums each of its ranks must report (its
        # senders' ``digests``); empty: every rank reports this snapshot's ``digests`` (a broadcast)
        self.expected: dict[str, list[dict[Key, str]]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.held.values())

    def begin(self, full: bool, active: bool = True) -> None:
        self.active = active
        self.full = full or not self.held
        self.digests, self.headers, self.expected = {}, {}, {}
        if self.full:
            self.held = {}

    def forget(self) -> None:
        self.held, self.digests, self.headers = {}, {}, {}

    def _keep(self, new: Tensor) -> Tensor:
        if self.where == "device":
            return new.clone()
        kept = torch.empty(new.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return kept.copy_(new)

    def encode(self, index: Key, new: Tensor, word: int) -> tuple[DeltaHeader, Tensor]:
        """The new bytes (flat uint8) of bucket ``index`` (or of a bucket's bytes for one engine rank) as a header
        and payload; the snapshot then holds them."""
        held = self.held.get(index)
        if self.full or held is None or held.numel() != new.numel():
            header = DeltaHeader("dense", word, new.numel(), new.numel() // word, new.numel())
            payload = new
            self.held[index] = self._keep(new)
        else:
            # on the host: the bucket comes over (the kept copy is then refreshed from it)
            here = new if held.device == new.device else new.to(held.device)
            header, payload = encode_into(here, held, word, self.allowed)
            if header.encoding == "dense":
                payload = new
            elif payload.device != new.device:
                payload = payload.to(new.device)
        self.digests[index] = checksum(new)
        self.headers[index] = header
        return header, payload
