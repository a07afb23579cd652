"""Stream plans: what a stream of one model needs before any data moves (the global table, the items each rank
emits, the buckets), made once and kept per model, config, converter, parallel layout and bucket settings. A
later stream reuses the kept plan after checking, in a few milliseconds, that no parameter was replaced, moved to
new storage, added or removed (all ranks agree through one all-reduce).

A caller that confirms later (``confirm_later``: ``WeightSync``) has the full check off its critical path: the kept
plan is reused once its copies are memory safe to launch (:meth:`ModuleGuard.addresses_hold`: every storage they
read still alive, which the plan ensures, and at its address), and after the copies, before anything they made is
used, :func:`confirm_kept_plan` runs the full check (:meth:`ModuleGuard.holds`). A parameter replaced or re-pointed
in between leaves its old storage alive and unmoved: the copies read valid, stale bytes, the confirmation says no,
the plan is forgotten and the caller does its work again with a new one."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from weightstream.converters.expected import hf_model_shapes
from weightstream.converters.mapping import Converter
from weightstream.converters.registry import get_converter
from weightstream.models.spec import ModelSpec
from weightstream.sources.base import Mode, ModuleGuard, Source, first_device
from weightstream.sources.names import WEIGHT_BUFFERS
from weightstream.sources.topology import Topology
from weightstream.streaming.items import StreamItem, check_blocks, make_item, nominal_item
from weightstream.streaming.plan import BucketPlan, plan_buckets
from weightstream.streaming.programs import CopyProgram
from weightstream.streaming.quantize import Quantization
from weightstream.wire.fp8 import BlockFP8

__all__ = ["StreamPlan", "into_key", "PlanSettings", "kept_or_new_plan", "confirm_kept_plan", "forget_plan",
           "make_plan", "clear_plans"]


@dataclass
class StreamPlan:
    """What a stream of one model needs before any data moves, made once and kept (under a key of the
    model, config, converter, layout and bucket settings): the global table, the bucket plan, and per
    bucket its copy program (made when the bucket is first produced)."""

    buckets: list[BucketPlan]
    items: list[StreamItem]
    source: Source  # the source that made the table: it holds this rank's live tensors
    device: torch.device
    guard: ModuleGuard | None
    quantization: Quantization | None = None
    programs: dict[int, CopyProgram] = field(default_factory=dict)
    buffers: list[Tensor | None] = field(default_factory=lambda: [None, None])  # kept bucket buffers (reuse)
    digest: str | None = None  # of every bucket's metadata (metadata_digest)
    checked_into: Any = None  # the key of the last write_into targets checked against every bucket
    all_mine: bool | None = None  # this rank makes every tensor itself (read once: can_write_into)
    # Last handed to a stream on the addresses check alone (``confirm_later``): not checked in full since.
    unconfirmed: bool = False

    def forget_targets(self, key: Any) -> None:
        """Drop every bucket's copies into the targets ``key`` of :meth:`BucketStream.write_into` (which hold views
        of them), checked or not."""
        for program in self.programs.values():
            for made in (into_key(key, False), into_key(key, True)):
                program.copies.pop(made, None)
                program.checks.pop(made, None)


def into_key(key: Any, checked: bool) -> tuple:
    """What a program keeps the copies into the targets ``key`` of :meth:`BucketStream.write_into` under: those
    that check what they write apart from those that do not."""
    return ("into", (key, "checked") if checked else key)


@dataclass(frozen=True)
class PlanSettings:
    """What a plan depends on besides the model, its config and the parallel layout."""

    mode: Mode
    bucket_bytes: int
    align: int
    split_dtypes: bool
    quantize: BlockFP8 | None = None


def kept_or_new_plan(source: Source, cfg: Any, spec: ModelSpec, settings: PlanSettings, *,
                     confirm_later: bool = False) -> tuple[StreamPlan, bool]:
    """The plan kept for this model and these settings where every rank still holds it (one vote), else a
    new one (kept for the next stream); and whether it was made now.

    ``confirm_later``: the caller confirms a kept plan with :func:`confirm_kept_plan` (every rank) once its copies
    are made and before anything they made is used (committed, written out): it is reused when its copies are
    memory safe to launch (:meth:`ModuleGuard.addresses_hold`), and the full check waits for the confirmation.
    Without it (anyone who iterates a stream themselves) the full check (:meth:`ModuleGuard.holds`) decides."""
    topo = source.topology
    converter = get_converter(spec.model_type)
    modules = list(source.modules())
    plan: StreamPlan | None = None
    kept: dict[tuple, StreamPlan] = {}
    key = (tuple(map(id, modules)), spec, id(converter), settings, _layout_key(topo))
    if modules:
        kept = _PLANS.get(modules[0], {})
        plan = kept.get(key)
    guard = plan.guard if plan is not None else None
    reuse = guard is not None and (guard.addresses_hold(modules) if confirm_later else guard.holds(modules))
    # Every rank joins the vote (where it has modules); a rank that votes to reuse has a plan.
    device = plan.device if plan is not None else first_device(modules)
    if bool(modules) and _everyone(reuse, topo, device) and plan is not None:
        plan.unconfirmed = confirm_later
        return plan, False
    plan = make_plan(source, modules, cfg, spec, converter, settings)
    if modules:
        kept.pop(key, None)
        kept[key] = plan
        while len(kept) > _KEEP:
            kept.pop(next(iter(kept)))
        _PLANS[modules[0]] = kept
    return plan, True


# Plans kept per model (its first module), a few per model (e.g. a full and a per-rank stream).
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, StreamPlan]] = weakref.WeakKeyDictionary()
_KEEP = 4


def clear_plans() -> None:
    """Forget every kept plan (the next stream of each model plans again)."""
    _PLANS.clear()


def forget_plan(plan: StreamPlan) -> None:
    """Forget ``plan`` where it is kept (the next stream of its model and settings makes a new one)."""
    for kept in list(_PLANS.values()):
        for key in [k for k, p in kept.items() if p is plan]:
            del kept[key]


def confirm_kept_plan(plan: StreamPlan, topo: Topology) -> bool:
    """On every rank whose stream reused ``plan`` (all of them, or none: they voted to), after its copies: whether
    the plan was still the model's when handed over. A plan checked in full then holds; one handed over on the
    addresses check alone (``confirm_later``) is checked in full now (:meth:`ModuleGuard.holds`). One vote; where it
    says no, the plan is forgotten (:func:`forget_plan`): what its copies made may be stale (a parameter replaced or
    re-pointed since it was made), to be made again from a new plan."""
    ok = True
    if plan.unconfirmed:
        roots = plan.guard.live_roots() if plan.guard is not None else None
        ok = roots is not None and plan.guard is not None and plan.guard.holds(roots)
    ok = _everyone(ok, topo, plan.device)
    if ok:
        plan.unconfirmed = False
    else:
        forget_plan(plan)
    return ok


def _layout_key(topo: Topology) -> tuple:
    groups = (topo.tp_group, topo.pp_group, topo.ep_group, topo.etp_group, topo.world_group)
    return (topo.tp_size, topo.tp_rank, topo.pp_size, topo.pp_rank, topo.ep_size, topo.ep_rank, topo.etp_size,
            topo.etp_rank, tuple(map(id, groups)))


def _everyone(ok: bool, topo: Topology, device: torch.device) -> bool:
    """Whether every rank says ``ok`` (one all-reduce; a single process decides alone)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(topo.world_group) == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=topo.world_group)
    return bool(flag.item())


def make_plan(source: Source, modules: Sequence[nn.Module], cfg: Any, spec: ModelSpec, converter: Converter,
              settings: PlanSettings) -> StreamPlan:
    """A new plan: the source's table, the items this rank emits (checked for block FP8 where asked), in
    dtype groups where every bucket holds one dtype, and the buckets (per-rank ones by TP rank 0's sizes)."""
    topo, mode = source.topology, settings.mode
    table = source.table(converter, spec, hf_model_shapes(cfg))
    quant = None if settings.quantize is None else Quantization.of(settings.quantize, converter)
    if quant is not None:
        check_blocks(table, spec, topo, mode, quant)
    items = [make_item(e, spec, topo, mode, quant)[0] for e in table
             if mode == "full" or e.ep_owner in (None, topo.ep_rank)]
    keys = None
    if settings.split_dtypes:
        first_seen: dict[torch.dtype, int] = {}
        for it in items:
            first_seen.setdefault(it.entry.dtype, len(first_seen))
        items = sorted(items, key=lambda it: first_seen[it.entry.dtype])  # stable: table order within a dtype
        keys = [it.entry.dtype for it in items]
    planning = [[o.nbytes for o in (it.outputs if mode == "full" else nominal_item(it, spec, topo, quant).outputs)]
                for it in items]
    device = source.live_device() or first_device(modules)
    return StreamPlan(
        buckets=plan_buckets(planning, settings.bucket_bytes, settings.align, keys=keys), items=items, source=source,
        device=device,
        guard=ModuleGuard(modules, WEIGHT_BUFFERS) if modules else None, quantization=quant,
    )

