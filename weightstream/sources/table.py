"""The global tensor table: every rank's metadata, matched to the converter and checked.

Built from the metadata of all ranks (exchanged once), so it is the same on every rank: the
same tensors in the same order, which is what makes the collectives line up. All problems
(unmapped names, missing or unexpected HF tensors, shape mismatches, inconsistent shards) are
collected and raised as one :class:`~weightstream.errors.ConversionError`, on every rank alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from weightstream.converters.mapping import Converter, Resolved
from weightstream.converters.ops import NotRepresentable, OpContext
from weightstream.errors import ProblemList
from weightstream.models.spec import ModelSpec, dtype_from_name
from weightstream.sources.names import order_key

__all__ = ["RankMeta", "HFOut", "TensorEntry", "build_table"]


@dataclass(frozen=True, slots=True)
class RankMeta:
    """What one rank reports: its coordinates and its tensors ``(name, shape, dtype, expert)``."""

    pp: int
    tp: int
    ep: int
    etp: int
    tensors: tuple[tuple[str, tuple[int, ...], str, bool], ...]


@dataclass(frozen=True, slots=True)
class HFOut:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One Megatron tensor of the whole model and where it lives."""

    resolved: Resolved
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    shard_dim: int | None  # dim split over its TP group (None when replicated or the group has 1 rank)
    group: str  # "tp" or "etp"
    parts: int  # ranks the tensor is split over (1 when not split)
    pp_owner: int
    ep_owner: int | None  # EP rank holding it (experts only)
    outputs: tuple[HFOut, ...]  # HF tensors of the whole tensor

    @property
    def name(self) -> str:
        return self.resolved.megatron_name

    @property
    def full_shape(self) -> tuple[int, ...]:
        if self.shard_dim is None:
            return self.local_shape
        shape = list(self.local_shape)
        shape[self.shard_dim] *= self.parts
        return tuple(shape)

    def shard_outputs(self, spec: ModelSpec, rank: int) -> tuple[HFOut, ...]:
        """HF tensors that TP rank ``rank`` makes from its own shard (per-rank mode)."""
        if self.shard_dim is None:
            return self.outputs
        meta = torch.empty(self.local_shape, dtype=self.dtype, device="meta")
        outs = self.resolved.mapping.op.to_hf(meta, OpContext(spec, parts=1, shard_rank=rank))
        return tuple(HFOut(n, tuple(o.shape), o.dtype) for n, o in zip(self.resolved.hf_names, outs, strict=True))


# What the ranks reported of one tensor: {(pp, ep or None): {(tp, etp): (shape, dtype)}}.
_Shards = dict[tuple[int, int], tuple[tuple[int, ...], str]]
_Owners = dict[tuple[int, int | None], _Shards]


def build_table(
    ranks: Sequence[RankMeta],
    converter: Converter,
    spec: ModelSpec,
    expected: dict[str, tuple[int, ...]] | None,
    *,
    tp_size: int,
    etp_size: int = 1,
) -> list[TensorEntry]:
    """Match every reported tensor to the converter, check it against ``expected`` HF shapes,
    and order the emitted ones. Raises one ConversionError listing every problem. ``expected`` None: there is no
    HF model to check against (transformers has no class for it), so the HF tensors are those the declarations
    make, each made once."""
    problems = ProblemList()
    seen, position = _reported(ranks)
    entries: list[TensorEntry] = []
    produced: dict[str, str] = {}
    for name in sorted(seen, key=lambda n: order_key(n, position[n])):
        entry = _entry(name, seen[name], converter, spec, problems, tp_size=tp_size, etp_size=etp_size)
        if entry is None:
            continue
        if entry.resolved.mapping.whole_or_split and _held_whole(entry, spec, expected):
            entry = replace(entry, shard_dim=None, parts=1)
        outputs = _hf_outputs(entry, spec, problems)
        if outputs is not None and _outputs_fit(name, outputs, expected, produced, problems):
            entries.append(_with_outputs(entry, outputs))
    for name in expected or ():
        if name not in produced:
            problems.add("HF tensors the model does not provide", name)
    problems.raise_if_any(f"cannot convert this {spec.model_type} model to Hugging Face tensors")
    return entries


def _held_whole(entry: TensorEntry, spec: ModelSpec, expected: dict[str, tuple[int, ...]] | None) -> bool:
    """Whether each rank holds all of a tensor that may be split or whole (``Mapping.whole_or_split``): what its
    own shape converts to is the whole of every HF tensor it makes (never known without ``expected``)."""
    if entry.shard_dim is None or expected is None:
        return False
    meta = torch.empty(entry.local_shape, dtype=entry.dtype, device="meta")
    try:
        outs = entry.resolved.mapping.op.to_hf(meta, OpContext(spec))
    except (ValueError, RuntimeError):
        return False
    return all(expected.get(n) == tuple(o.shape) for n, o in zip(entry.resolved.hf_names, outs, strict=True))


def _reported(ranks: Sequence[RankMeta]) -> tuple[dict[str, _Owners], dict[str, int]]:
    """Every rank's tensors by name and owner, and the position at which each name was first listed."""
    seen: dict[str, _Owners] = {}
    position: dict[str, int] = {}
    for rank in ranks:
        for pos, (name, shape, reported_dtype, expert) in enumerate(rank.tensors):
            position.setdefault(name, pos)
            owner = (rank.pp, rank.ep if expert else None)
            seen.setdefault(name, {}).setdefault(owner, {})
            # Record by TP rank here; re-keyed by ETP rank for expert-TP tensors in _local_shape.
            seen[name][owner][(rank.tp, rank.etp)] = (tuple(shape), reported_dtype)
    return seen, position


def _entry(name: str, owners: _Owners, converter: Converter, spec: ModelSpec, problems: ProblemList, *,
           tp_size: int, etp_size: int) -> TensorEntry | None:
    """The entry of tensor ``name`` (its HF outputs still empty); None when it is not emitted or has a problem
    (added to ``problems``)."""
    resolved = converter.resolve(name, spec)
    if resolved is None:
        problems.add("Megatron tensors no mapping covers", name)
        return None
    if len({pp for pp, _ in owners}) > 1 and resolved.emit:
        problems.add("tensors held by several pipeline stages", f"{name}: stages {sorted({p for p, _ in owners})}")
        return None
    if not resolved.emit:
        return None
    ep_owners = sorted({ep for _, ep in owners if ep is not None})
    if len(ep_owners) > 1:
        problems.add(
            "experts held by several expert-parallel ranks (local expert ids reported as global?)",
            f"{name}: EP ranks {ep_owners}",
        )
        return None
    mapping = resolved.mapping
    pp_owner, ep_owner = next(iter(owners))
    local = _local_shape(name, owners[(pp_owner, ep_owner)], mapping.tp_group, problems)
    if local is None:
        return None
    local_shape, dtype_str = local
    group_size = etp_size if mapping.tp_group == "etp" else tp_size
    tp_dim = mapping.tp_dim if group_size > 1 else None
    if tp_dim is not None and tp_dim >= len(local_shape):
        problems.add("shape mismatches", f"{name}: partition dim {mapping.tp_dim} but shape {local_shape}")
        return None
    return TensorEntry(
        resolved=resolved,
        dtype=dtype_from_name(dtype_str),
        local_shape=local_shape,
        shard_dim=tp_dim,
        group=mapping.tp_group,
        parts=group_size if tp_dim is not None else 1,
        pp_owner=pp_owner,
        ep_owner=ep_owner,
        outputs=(),
    )


def _local_shape(name: str, shards: _Shards, group: str, problems: ProblemList) -> tuple[tuple[int, ...], str] | None:
    """The ``(shape, dtype)`` every rank of the tensor's ``group`` ("tp" or "etp") reported for its shard; None
    when they differ (a problem added)."""
    by_group_rank: dict[int, tuple[tuple[int, ...], str]] = {}
    for (tp, etp), info in shards.items():
        by_group_rank[etp if group == "etp" else tp] = info
    variants = set(by_group_rank.values())
    if len(variants) != 1:
        problems.add("tensors whose shards differ between ranks", f"{name}: {sorted(variants)}")
        return None
    ((local_shape, dtype_str),) = variants
    return local_shape, dtype_str


def _hf_outputs(entry: TensorEntry, spec: ModelSpec, problems: ProblemList) -> tuple[HFOut, ...] | None:
    """The HF tensors the converter makes of the whole tensor (on the meta device); None when it cannot (a
    problem added)."""
    resolved = entry.resolved
    meta = torch.empty(entry.full_shape, dtype=entry.dtype, device="meta")
    try:
        outs = resolved.mapping.op.to_hf(meta, OpContext(spec, parts=entry.parts))
    except NotRepresentable as exc:
        problems.add("Megatron tensors the HF model has no place for", f"{entry.name}: {exc}")
        return None
    except (ValueError, RuntimeError) as exc:
        targets = ", ".join(resolved.hf_names)
        problems.add("shape mismatches", f"{targets}: cannot be made from {entry.name} {entry.full_shape}: {exc}")
        return None
    return tuple(HFOut(n, tuple(o.shape), o.dtype) for n, o in zip(resolved.hf_names, outs, strict=True))


def _outputs_fit(name: str, outputs: tuple[HFOut, ...], expected: dict[str, tuple[int, ...]] | None,
                 produced: dict[str, str], problems: ProblemList) -> bool:
    """Whether every HF tensor made from ``name`` is one the config expects, of its shape, and made once;
    records them in ``produced`` (HF name -> Megatron name) and adds a problem for each that is not."""
    fit = True
    for out in outputs:
        if out.name in produced:
            problems.add("HF tensors produced twice", f"{out.name}: from {produced[out.name]} and {name}")
            fit = False
            continue
        produced[out.name] = name
        if expected is None:
            continue
        want = expected.get(out.name)
        if want is None:
            problems.add("HF tensors the config does not have", f"{out.name} (from {name})")
            fit = False
        elif want != out.shape:
            problems.add("shape mismatches",
                         f"{out.name}: config says {want}, model gives {out.shape} (from {name})")
            fit = False
    return fit


def _with_outputs(entry: TensorEntry, outputs: tuple[HFOut, ...]) -> TensorEntry:
    return replace(entry, outputs=outputs)
