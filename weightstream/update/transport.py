"""Which transport an update takes, and why: from what the engines declare they can do, the trainer's parallel
layout and the model (IPC for colocated engines, point-to-point per TP rank where the engine's layout matches the
trainer's or the engine reshards, broadcast otherwise); and whether every engine serves the layout sent."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightstream.common.layout import ALIGN
from weightstream.converters.registry import get_converter
from weightstream.engines.base import BROADCAST, IPC, P2P, RESHARD, EngineAdapter, EngineInfo, IpcSession
from weightstream.engines.formats import describe_format
from weightstream.models.spec import ModelSpec
from weightstream.sources.base import Mode
from weightstream.sources.topology import Topology
from weightstream.update.options import TRANSPORTS
from weightstream.wire.fp8 import BlockFP8
from weightstream.wire.handles import gpu_uuid

__all__ = ["Decision", "choose_transport", "reshards", "check_formats"]

log = logging.getLogger("weightstream")


def _local_gpu_uuids() -> set[str]:
    if not torch.cuda.is_available():
        return set()
    return {gpu_uuid(torch.cuda.current_device())}


@dataclass(frozen=True)
class Decision:
    """What an update (or :meth:`WeightSync.prepare`) decided on rank 0, the same on every rank."""

    transport: str
    reason: str
    one_dtype: bool = False  # an engine takes buckets of one dtype only (SINGLE_DTYPE)
    reshard: bool = False  # P2P into an engine that declares its layout (RESHARD): any TP and EP on both sides
    # IPC into one engine that declares IPC_SESSION: the update's request opens and commits its session (no pause
    # before it, no commit after it)
    session: IpcSession | None = None

    @property
    def mode(self) -> Mode:
        return "per_rank" if self.transport == "p2p" else "full"

    @property
    def align(self) -> int:
        """Tensor starts in a bucket: packed back to back for a broadcast (engines read it as one run)."""
        return 1 if self.transport == "broadcast" else ALIGN


def choose_transport(requested: str, engines: Sequence[EngineAdapter], topo: Topology, spec: ModelSpec,
                     colocated: bool | None, *, p2p_source: bool = True) -> tuple[str, str]:
    """(transport, why), from what the engines declare they can do. Only rank 0 calls it (it asks the engines)."""
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {requested!r}")
    infos = [e.info() for e in engines]
    unable = {kind: [e.url for e, i in zip(engines, infos, strict=True) if not i.can(kind)]
              for kind in (IPC, BROADCAST)}
    if requested in ("ipc", "broadcast"):
        return _as_asked(requested, unable[IPC if requested == "ipc" else BROADCAST])
    if requested == "auto" and not unable[IPC]:
        shared = any(_local_gpu_uuids() & set(i.gpu_uuids) for i in infos)
        if colocated or (colocated is None and shared):
            return "ipc", "the engine shares this trainer's GPU (colocated)"
    reshard = reshards(engines)
    failed = _p2p_problems(engines, infos, topo, spec, p2p_source, reshard)
    if not failed and reshard:
        engine_ep = f" EP {infos[0].ep_size}" if infos[0].ep_size > 1 else ""
        return "p2p", (f"engine TP {infos[0].tp_size}{engine_ep}, trainer TP {topo.tp_size} EP {topo.ep_size}: each "
                       "trainer rank sends each engine rank the rows and columns of its shards that it needs "
                       "(resharded P2P)")
    if not failed and len(engines) > 1:
        return "p2p", (f"{len(engines)} engines at the trainer's TP {topo.tp_size}, PP 1: each engine's TP rank r gets "
                       f"its shards from TP rank r of data-parallel replica (its index mod {topo.dp_size})")
    if not failed:
        return "p2p", "engine TP equals trainer TP, engine PP 1: each TP rank sends its own shards"
    reason = "P2P preconditions failed: " + "; ".join(failed)
    if unable[BROADCAST]:
        raise ValueError(f"no transport fits: {reason}; and engines {unable[BROADCAST]} do not receive broadcasts")
    if requested == "p2p":
        log.warning("falling back to broadcast: %s", reason)
        return "broadcast", "fell back from p2p: " + reason
    return "broadcast", reason


def _as_asked(transport: str, unable: list[str]) -> tuple[str, str]:
    """An IPC or broadcast transport asked for by name: every engine must declare it."""
    if unable:
        what = "receive IPC buckets" if transport == "ipc" else "receive broadcasts"
        raise ValueError(f"transport {transport!r} asked for, but engines {unable} do not {what}")
    return transport, "asked for"


def _p2p_problems(engines: Sequence[EngineAdapter], infos: Sequence[EngineInfo], topo: Topology, spec: ModelSpec,
                  p2p_source: bool, reshard: bool = False) -> list[str]:
    """Why point-to-point per TP rank does not fit (nothing: it does). ``reshard``: the engine takes any layout
    (:data:`RESHARD`), so the trainer's TP and EP need not be its."""
    failed = []
    if not p2p_source:
        failed.append("the source has no TP ranks that send their own shards (P2P sends from Megatron's TP ranks)")
    for e, i in zip(engines, infos, strict=True):
        if not i.can(P2P):
            failed.append(f"engine {e.url} ({i.engine}) does not receive per-rank buckets")
        if i.tp_size != topo.tp_size and not reshard:
            failed.append(f"engine {e.url} TP {i.tp_size} != trainer TP {topo.tp_size}"
                          + _why_not_reshard(i, len(engines)))
        if i.pp_size != 1:
            failed.append(f"engine {e.url} PP {i.pp_size} != 1")
        if i.ep_size > 1 and spec.is_moe and not reshard:
            failed.append(f"engine {e.url} EP {i.ep_size} holds whole experts, which per-rank buckets carry as TP "
                          "shards" + _why_not_reshard(i, len(engines)))
    if reshard:
        return failed
    if topo.ep_size > 1:
        failed.append(f"trainer EP {topo.ep_size} (experts would need an engine with the same EP)")
    if spec.is_moe and topo.etp_size != topo.tp_size:
        failed.append(f"trainer expert-TP {topo.etp_size} != TP {topo.tp_size}")
    converter = get_converter(spec.model_type)
    if not converter.per_rank:
        failed.append(f"the {spec.model_type} converter does not support per-rank export")
    return failed


def reshards(engines: Sequence[EngineAdapter]) -> bool:
    """Whether P2P into ``engines`` is resharded: one engine, which declares its layout (:data:`RESHARD`); bf16 or
    block FP8 (each shard quantized in its own blocks, which are the whole tensor's where the trainer's and the
    engine's shards both fall on block boundaries: the trainer's stream and the engine's own layout check that).
    Several engines take P2P at the trainer's TP (each from its own replica)."""
    return len(engines) == 1 and engines[0].info().can(RESHARD)


def _why_not_reshard(info: EngineInfo, engines: int) -> str:
    """Why an engine of another TP is not resharded into."""
    if not info.can(RESHARD):
        return f" (the {info.engine} engine does not declare its layout: no resharding)"
    return f" (resharding serves one engine; {engines} given)"



def check_formats(engines: Sequence[EngineAdapter], quantize: BlockFP8 | None) -> None:
    """Every engine serves the weight layout the update sends (block FP8 of the same block and scale format, or
    unquantized), and no layout stated for an engine contradicts what it reports: one error naming each engine
    that does not, before any bytes move."""
    def serves(info: EngineInfo) -> str:
        if info.fp8 is None and info.quantization is not None:
            return f"{info.quantization} weights without saying their block layout"
        return describe_format(info.fp8)

    wrong, unstated = [], False
    for e in engines:
        info = e.info()
        if info.fp8_conflicts:
            wrong.append(f"{e.url}: " + "; ".join(info.fp8_conflicts))
        elif info.fp8 != quantize or (quantize is None and info.quantization is not None):
            wrong.append(f"{e.url} serves {serves(info)}")
            unstated |= quantize is not None and info.fp8 is None
    if wrong:
        hint = " (pass quantize= to match)" if quantize is None else ""
        if unstated:
            hint = (" (where an engine does not report its layout, state it: fp8= or model_path= on its adapter, "
                    "engine_fp8= or engine_model_path= on WeightSync)")
        raise ValueError(f"the update sends {describe_format(quantize)}, but engine " + "; engine ".join(wrong) + hint)

