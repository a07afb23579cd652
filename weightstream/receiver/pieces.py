"""A resharded bucket on one engine rank: pieces of its tensors from several trainer ranks, checked to tile this
rank's part of each exactly (:func:`~weightstream.streaming.reshard.tiling_problems`) and put together, or
refused whole with every problem named. A tensor another rank holds alone (``elsewhere``: an expert under expert
parallelism, by its owner) is no part of this rank's: a piece of it is refused, naming its owner."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch
from torch import Tensor

from weightstream.streaming.bucket import Shard, TensorMeta
from weightstream.streaming.reshard import EngineLayout, tiling_problems

__all__ = ["Weight", "NOBODY_ELSE", "engine_layout", "wanted", "piece_problems", "assemble"]


Weight = tuple[str, Tensor, Shard | None]
NOBODY_ELSE: Mapping[str, int] = MappingProxyType({})  # every tensor is held (or split) by every rank


def engine_layout(params: Mapping[str, tuple[Tensor, int | None]], size: int,
                  owners: Mapping[str, int] = NOBODY_ELSE) -> EngineLayout:
    """The layout an engine of ``size`` ranks declares from its table of parameters (checkpoint name ->
    (this rank's tensor, the dim it is split on or None)) and the owner of each tensor one rank holds alone."""
    return EngineLayout(size, {name: dim for name, (_, dim) in params.items() if dim is not None}, dict(owners))


def wanted(params: Mapping[str, tuple[Tensor, int | None]], rank: int, size: int,
           name: str) -> tuple[Shard | None, tuple[int, ...]] | None:
    """This rank's part of ``name`` (None: whole) and the whole tensor's shape; None where it holds no such
    tensor."""
    entry = params.get(name)
    if entry is None:
        return None
    param, dim = entry
    if dim is None or size == 1:
        return None, tuple(param.shape)
    n = param.shape[dim]
    whole = list(param.shape)
    whole[dim] = n * size
    return Shard(dim, rank * n, n, n * size), tuple(whole)


def _shape_problem(meta: TensorMeta, whole: tuple[int, ...]) -> str | None:
    expected = list(whole)
    if meta.shard is not None:
        if meta.shard.dim >= len(whole):
            return f"{meta.name}: placed on dim {meta.shard.dim} of a {len(whole)}-D tensor"
        expected[meta.shard.dim] = meta.shard.length
    if tuple(expected) != tuple(meta.shape):
        return f"{meta.name}: a piece of shape {tuple(meta.shape)} placed at {meta.shard} in {whole}"
    return None


def piece_problems(metas: Sequence[TensorMeta], params: Mapping[str, tuple[Tensor, int | None]], rank: int,
                   size: int, *, elsewhere: Mapping[str, int] = NOBODY_ELSE) -> list[str]:
    """What is wrong with a resharded bucket's pieces (``metas``, each placed in its whole tensor by its ``shard``) on
    this rank: a tensor it does not hold (another rank's alone: ``elsewhere``, by owner), a piece of the wrong shape,
    rows missing or given twice; nothing where they tile this rank's part of each tensor exactly."""
    by_name: dict[str, list[TensorMeta]] = {}
    for meta in metas:
        by_name.setdefault(meta.name, []).append(meta)
    problems: list[str] = []
    for name, got in by_name.items():
        want = wanted(params, rank, size, name)
        if want is None:
            owner = elsewhere.get(name)
            problems.append(f"{name}: the model has no such tensor" if owner is None else
                            f"{name}: held by engine rank {owner} alone, not by this rank ({rank})")
            continue
        part, whole = want
        problems += [p for m in got if (p := _shape_problem(m, whole)) is not None]
        problems += tiling_problems(name, [m.shard for m in got], part, whole, "the senders")
    return problems


def assemble(pieces: Sequence[tuple[TensorMeta, Tensor]], params: Mapping[str, tuple[Tensor, int | None]], rank: int,
             size: int, *, elsewhere: Mapping[str, int] = NOBODY_ELSE) -> tuple[list[Weight], list[str]]:
    """The tensors this rank loads from ``pieces`` (each placed in the whole tensor by its ``meta.shard``):
    per name this rank's part, with its placement; or nothing and every problem (:func:`piece_problems`)."""
    problems = piece_problems([m for m, _ in pieces], params, rank, size, elsewhere=elsewhere)
    if problems:
        return [], problems
    by_name: dict[str, list[tuple[TensorMeta, Tensor]]] = {}
    for meta, t in pieces:
        by_name.setdefault(meta.name, []).append((meta, t))
    out: list[Weight] = []
    for name, got in by_name.items():
        want = wanted(params, rank, size, name)
        assert want is not None  # (checked above)
        part, whole = want
        out.append((name, _put_together(got, part, whole), part))
    return out, []


def _put_together(got: list[tuple[TensorMeta, Tensor]], part: Shard | None, whole: tuple[int, ...]) -> Tensor:
    """The part (or the whole) made of the pieces ``got`` (checked to tile it): a piece that is all of it as it
    is, else the pieces copied into one new tensor."""
    if len(got) == 1:
        return got[0][1]
    meta0 = got[0][0]
    shard0 = meta0.shard
    assert shard0 is not None  # several pieces tile the part: each is placed
    dim = shard0.dim
    shape = list(whole)
    base = 0
    if part is not None:
        shape[dim], base = part.length, part.start
    out = torch.empty(shape, dtype=meta0.dtype, device=got[0][1].device)
    for meta, t in got:
        assert meta.shard is not None
        out.narrow(dim, meta.shard.start - base, meta.shard.length).copy_(t)
    return out
