"""Resharding: which rows or columns of which tensors each trainer rank sends each engine rank.

A per-rank stream yields, on every sending trainer rank, its own shards of the HF tensors (each a
:class:`Shard` of the whole, or the whole tensor where the rank holds it whole). An engine declares how it
splits the HF tensors over its ranks (:class:`EngineLayout`: its size, for each tensor the dim it splits, or
none where every rank holds it whole, and the one rank that holds a tensor whole where no other holds it: an
expert under expert parallelism). The plan of one bucket (:func:`plan_bucket`) gives, for each pair
(trainer rank, engine rank) that has anything to say, the pieces: the part of a tensor the trainer rank holds
that the engine rank needs (where it lies in the trainer's tensor, and where in the whole). Where several
trainer ranks hold the same part (a norm on every TP rank, a dense tensor on every EP rank), engine rank e
takes it from the ``e % n``-th of them, so the senders share the load.

The engine checks that the pieces of each of its tensors tile exactly its own part (:func:`tiling_problems`),
or refuses the whole bucket, naming what is missing or overlapping.

Planning is pure: it reads metadata only, the same on every rank, and is made once per stream plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from weightstream.common.layout import ALIGN, layout
from weightstream.errors import ConversionError
from weightstream.streaming.bucket import Shard, TensorMeta, extent
from weightstream.wire.fp8 import FP8

__all__ = [
    "EngineLayout", "Piece", "Route", "full_shape", "plan_bucket", "coverage_problems", "tiling_problems",
    "is_identity", "off_grid"
]


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """How an engine holds the HF tensors over its ``size`` ranks: ``dims[name]`` is the dim the tensor is
    split on, rank e holding the e-th of ``size`` equal parts; ``owners[name]`` the one rank that holds the
    tensor, whole (an expert under expert parallelism: rank e holds experts ``[e·E/ep, (e+1)·E/ep)``); a tensor
    it names in neither (or names with a dim of None) is held whole by every rank."""

    size: int
    dims: Mapping[str, int | None] = field(default_factory=dict)
    owners: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = [f"{name}: owned by engine rank {rank}, outside 0..{self.size - 1}"
                    for name, rank in self.owners.items() if not 0 <= rank < self.size]
        problems += [f"{name}: split on dim {self.dims[name]} and owned by engine rank {rank} alone"
                     for name, rank in self.owners.items() if self.dims.get(name) is not None]
        if problems:
            raise ValueError(f"an engine layout of {self.size} ranks that cannot be: " + "; ".join(sorted(problems)))

    def ranks(self, name: str) -> range:
        """The engine ranks that hold ``name`` (or a part of it): its owner, or every rank."""
        owner = self.owners.get(name)
        return range(self.size) if owner is None else range(owner, owner + 1)

    def part(self, name: str, full_shape: Sequence[int], rank: int) -> Shard | None:
        """Engine rank ``rank``'s part of ``name`` (whole: None); ValueError where another rank owns it."""
        owner = self.owners.get(name)
        if owner is not None:
            if owner != rank:
                raise ValueError(f"{name}: held by engine rank {owner} alone, not by rank {rank}")
            return None
        dim = self.dims.get(name)
        if dim is None or self.size == 1:
            return None
        full = full_shape[dim]
        if full % self.size:
            raise ValueError(f"{name}: {full} along dim {dim} does not split over {self.size} engine ranks")
        n = full // self.size
        return Shard(dim, rank * n, n, full)


@dataclass(frozen=True, slots=True)
class Piece:
    """A part of one tensor of a trainer rank's bucket: ``cut`` (dim, start, length) of the tensor as that
    rank holds it (None: all of it), placed at ``dest`` in the whole HF tensor (None: it is the whole)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    cut: tuple[int, int, int] | None
    dest: Shard | None
    source: int  # index of the tensor in the trainer rank's bucket metadata


@dataclass(frozen=True, slots=True)
class Route:
    """What trainer rank ``sender`` sends engine rank ``engine_rank`` of one bucket: ``pieces``, laid out as
    ``metas`` in the buffer it sends (``whole_bucket``: the bucket's own buffer, as it is, no packing)."""

    sender: int
    engine_rank: int
    pieces: tuple[Piece, ...]
    metas: tuple[TensorMeta, ...]
    nbytes: int
    whole_bucket: bool


def full_shape(meta: TensorMeta) -> tuple[int, ...]:
    """The shape of the whole HF tensor ``meta`` is (a shard of)."""
    if meta.shard is None:
        return meta.shape
    shape = list(meta.shape)
    shape[meta.shard.dim] = meta.shard.full
    return tuple(shape)


def _span(shard: Shard | None, dim: int, shape: Sequence[int]) -> tuple[int, int]:
    """The range ``[lo, hi)`` along ``dim`` that ``shard`` covers of a whole tensor of ``shape``."""
    if shard is None:
        return 0, shape[dim]
    return shard.start, shard.start + shard.length


def _piece(meta: TensorMeta, k: int, want: Shard | None, problems: list[str]) -> Piece | None:
    """What of ``meta`` (a trainer rank's tensor, index ``k`` in its bucket) goes to an engine rank whose part
    is ``want``; None where nothing does (or the two splits cross: a problem added)."""
    have, whole = meta.shard, full_shape(meta)
    if want is None:  # the engine rank holds the tensor whole: all of what the trainer rank has
        return Piece(meta.name, meta.dtype, meta.shape, None, have, k)
    if have is not None and have.dim != want.dim:
        problems.append(f"{meta.name}: the trainer splits dim {have.dim}, the engine dim {want.dim}")
        return None
    lo, hi = _span(have, want.dim, whole)
    lo, hi = max(lo, want.start), min(hi, want.start + want.length)
    if lo >= hi:
        return None
    start = lo - (have.start if have is not None else 0)
    shape = list(meta.shape)
    shape[want.dim] = hi - lo
    dest = Shard(want.dim, lo, hi - lo, whole[want.dim])
    if have is not None and (lo, hi) == (have.start, have.start + have.length):
        return Piece(meta.name, meta.dtype, meta.shape, None, dest, k)
    return Piece(meta.name, meta.dtype, tuple(shape), (want.dim, start, hi - lo), dest, k)


def _holders(senders: Sequence[Sequence[TensorMeta]]) -> dict[tuple[str, Shard | None], list[tuple[int, int]]]:
    """Per (name, placement) held: the (sender, index in its bucket) that hold it, in sender order."""
    out: dict[tuple[str, Shard | None], list[tuple[int, int]]] = {}
    for s, metas in enumerate(senders):
        for k, m in enumerate(metas):
            out.setdefault((m.name, m.shard), []).append((s, k))
    return out


def plan_bucket(senders: Sequence[Sequence[TensorMeta]], engine: EngineLayout, align: int = ALIGN) -> list[Route]:
    """The routes of one bucket: ``senders[s]`` is the bucket's metadata as trainer rank s yields it. Raises
    one :class:`ConversionError` listing every tensor the senders do not cover whole, or whose split crosses
    the engine's."""
    problems: list[str] = []
    problems += coverage_problems(senders)
    picked: dict[tuple[int, int], list[Piece]] = {}
    for (name, _), holders in _holders(senders).items():
        for e in engine.ranks(name):  # an owned tensor (an expert under EP) goes to its owner alone
            s, k = holders[e % len(holders)]
            meta = senders[s][k]
            try:
                want = engine.part(name, full_shape(meta), e)
            except ValueError as exc:
                problems.append(str(exc))
                continue
            piece = _piece(meta, k, want, problems)
            if piece is not None:
                picked.setdefault((s, e), []).append(piece)
    if problems:
        raise ConversionError("cannot reshard this bucket for the engine's layout",
                              {"tensors": sorted(set(problems))})
    return [_route(s, e, sorted(pieces, key=lambda p: p.source), senders[s], align)
            for (s, e), pieces in sorted(picked.items())]


def _route(sender: int, engine_rank: int, pieces: list[Piece], metas: Sequence[TensorMeta], align: int) -> Route:
    whole = len(pieces) == len(metas) and all(p.cut is None for p in pieces)
    if whole:
        placed = tuple(TensorMeta(m.name, m.dtype, m.shape, m.offset, p.dest)
                       for m, p in zip(metas, pieces, strict=True))
        return Route(sender, engine_rank, tuple(pieces), placed, extent(metas), True)
    sizes = [[_nbytes(p)] for p in pieces]
    offsets, end = layout(sizes, align)
    placed = tuple(TensorMeta(p.name, p.dtype, p.shape, off, p.dest) for p, (off,) in zip(pieces, offsets, strict=True))
    return Route(sender, engine_rank, tuple(pieces), placed, end, False)


def _nbytes(p: Piece) -> int:
    n = p.dtype.itemsize
    for d in p.shape:
        n *= d
    return n


def coverage_problems(senders: Sequence[Sequence[TensorMeta]]) -> list[str]:
    """Every tensor whose parts, over all senders, do not tile the whole exactly once (replicas aside)."""
    parts: dict[str, set[Shard | None]] = {}
    wholes: dict[str, tuple[int, ...]] = {}
    for metas in senders:
        for m in metas:
            parts.setdefault(m.name, set()).add(m.shard)
            wholes[m.name] = full_shape(m)
    problems = []
    for name, held in parts.items():
        if None in held:
            continue  # held whole by some sender
        problems += tiling_problems(name, list(held), None, wholes[name], "the trainer ranks")
    return problems


def tiling_problems(name: str, dests: Sequence[Shard | None], want: Shard | None, whole: Sequence[int],
                    who: str = "the pieces") -> list[str]:
    """What is wrong with ``dests`` (where each piece of ``name`` lies in the whole tensor of shape ``whole``;
    None: a whole tensor) as a tiling of ``want`` (a part of the whole; None: all of it): rows missing,
    overlapping or outside, pieces on another dim, or more than one whole. Empty where they tile it exactly."""
    if want is None and len(dests) == 1 and dests[0] is None:
        return []
    if any(d is None for d in dests):
        return [f"{name}: {who} give the whole tensor" + (" more than once" if want is None else
                                                          f" where only {want} is wanted")]
    dims = {d.dim for d in dests if d is not None}
    dim = want.dim if want is not None else min(dims)
    if dims != {dim}:
        return [f"{name}: {who} split dims {sorted(dims)}, the part wanted is on dim {dim}"]
    lo, hi = (want.start, want.start + want.length) if want is not None else (0, whole[dim])
    return _gaps(name, [(d.start, d.start + d.length) for d in dests if d is not None], lo, hi, dim, who)


def _gaps(name: str, spans: Iterable[tuple[int, int]], lo: int, hi: int, dim: int, who: str) -> list[str]:
    """Where ``spans`` fail to cover ``[lo, hi)`` exactly once."""
    problems, pos = [], lo
    for a, b in sorted(spans):
        if a < lo or b > hi:
            problems.append(f"{name}: {who} give dim {dim} [{a}, {b}), outside [{lo}, {hi})")
        if a > pos:
            problems.append(f"{name}: dim {dim} [{pos}, {a}) missing")
        elif a < pos:
            problems.append(f"{name}: dim {dim} [{a}, {min(pos, b)}) given twice")
        pos = max(pos, b)
    if pos < hi:
        problems.append(f"{name}: dim {dim} [{pos}, {hi}) missing")
    return problems


def is_identity(routes: Sequence[Route], senders: int) -> bool:
    """Whether the routes are trainer rank r sending its whole bucket to engine rank r, and nothing else (the
    per-rank bucket as it is: what an engine of the trainer's TP takes)."""
    return len(routes) == senders and all(r.whole_bucket and r.sender == r.engine_rank for r in routes)


def off_grid(senders: Sequence[Sequence[Sequence[TensorMeta]]], layout: EngineLayout,
             block: tuple[int, int]) -> list[str]:
    """The block-FP8 weights (float8 values) among the senders' buckets whose part on an engine rank would not fall
    on the block grid (``block``: rows, columns): each engine rank must hold whole blocks, with their scales, for its
    part to be the same values and scales as the whole tensor's (an engine holds such a part dequantized, which
    resharded pieces cannot give it). One line per weight; nothing where every part falls on the grid."""
    problems: dict[str, str] = {}
    for bucket in (b for s in senders for b in s):
        for meta in bucket:
            dim = layout.dims.get(meta.name)
            if meta.dtype != FP8 or dim is None or layout.size == 1 or meta.name in problems:
                continue
            whole = full_shape(meta)
            along = block[1] if dim == len(whole) - 1 else block[0]
            if whole[dim] % layout.size or (whole[dim] // layout.size) % along:
                problems[meta.name] = (f"{meta.name}: {whole[dim]} along dim {dim} over {layout.size} engine ranks "
                                       f"is not in whole blocks of {along}")
    return list(problems.values())
