"""``update_weights``: between two rollout rounds, every trainer rank calls it and the engines hold the
new weights. It pauses generation, streams, loads, commits, resumes; chooses the transport (IPC for
colocated engines, point-to-point per TP rank when the engine's layout matches the trainer's,
broadcast otherwise) and says why; tags the update with a version the engine reports back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from weightstream.common.bounds import Deadline, cleanup_budget
from weightstream.common.layout import ALIGN
from weightstream.converters.fp8 import BlockFP8
from weightstream.converters.registry import get_converter, model_spec
from weightstream.engines import ADAPTERS, detect, make_adapter
from weightstream.engines.base import (
    BROADCAST,
    COMMIT_AND_RESUME,
    IPC,
    P2P,
    PAUSE_AND_BEGIN,
    PREPARE_COMMIT,
    RELEASE_MEMORY,
    RESHARD,
    ROLLBACK,
    SINGLE_DTYPE,
    CommitsAndResumes,
    EngineAdapter,
    EngineError,
    EngineInfo,
    MemoryEngine,
    PausesAndBegins,
    PreparesCommits,
    capable,
    describe_format,
    implementing,
    require,
)
from weightstream.errors import UpdateError, WeightstreamError
from weightstream.models.spec import ModelSpec, load_hf_config
from weightstream.sinks import BroadcastSink, IPCSink, P2PSink
from weightstream.sinks.base import Delivery, PipelinedSink, Sink
from weightstream.sinks.delta import DeltaReport, DeltaTracker
from weightstream.sinks.reshard import ReshardSink
from weightstream.sources import as_source
from weightstream.sources.base import Source
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import extent
from weightstream.streaming.delta import Snapshot, warm_kernels, word_size
from weightstream.streaming.stream import DEFAULT_BUCKET_BYTES, BucketStream, Mode, stream_hf_weights
from weightstream.wire.handles import gpu_uuid

__all__ = [
    "log", "TRANSPORTS", "UpdateReport", "Decision", "choose_transport", "reshards", "WeightSync", "engines_list",
    "update_weights"
]


log = logging.getLogger("weightstream")

TRANSPORTS = ("auto", "ipc", "broadcast", "p2p")


@dataclass
class UpdateReport:
    transport: str
    reason: str
    mode: str
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    gathers: int = 0
    weight_version: str | None = None
    engines: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    metadata_ahead: bool = False  # broadcast / IPC: every bucket's metadata went ahead in one request
    direct: bool = False  # IPC: the trainer wrote every tensor straight into the engine's weights (one copy)
    planned: bool = False  # this update made the stream's plan (False: it used the one kept, e.g. by prepare)
    copies_made: int = 0  # buckets whose batched copies this update made (0: all were kept)
    formed_group: bool = False  # broadcast / P2P: this update formed the group to the engines (not kept)
    delta: DeltaReport | None = None  # WeightSync(delta=True): full or deltas, and why; the check's result

    def summary(self) -> str:
        total = self.seconds.get("total", 0.0)
        how = ", written into the engine's weights" if self.direct else ""
        delta = f"; {self.delta.summary()}" if self.delta is not None else ""
        return (f"{self.transport} ({self.reason}{how}): {self.tensors} tensors, {self.bytes / 1e6:.2f} MB in "
                f"{self.buckets} buckets, {total:.3f} s, version {self.weight_version}{delta}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _share(obj: Any) -> Any:
    """``obj`` of global rank 0, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group_src=0)
    return box[0]


def _as_update_error(phase: str, exc: BaseException, engines: Sequence[str]) -> WeightstreamError:
    """``exc`` as the error every rank raises: weightstream's own errors as they are (a conversion
    problem stays a :class:`ConversionError`), anything else as an :class:`UpdateError` of ``phase``."""
    if isinstance(exc, WeightstreamError) and not isinstance(exc, EngineError):
        return exc
    return UpdateError(phase, f"{type(exc).__name__}: {exc}" if not isinstance(exc, EngineError) else str(exc), engines)


def _first_error(err: BaseException | None) -> BaseException | None:
    """The lowest failing rank's error, on every rank (tagged with that rank when it is not rank 0)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return err
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, err)
    for rank, e in enumerate(everyone):
        if e is not None:
            if rank and isinstance(e, UpdateError):
                return UpdateError(e.phase, f"on trainer rank {rank}: {e.detail}", e.engines)
            return e
    return None


def _committed_on(err: WeightstreamError, committed: Sequence[str], urls: Sequence[str]) -> WeightstreamError:
    """A commit that failed after some engines had committed says which (the others' sessions are aborted)."""
    if not committed or not isinstance(err, UpdateError):
        return err
    left = [u for u in urls if u not in committed]
    return UpdateError(err.phase, f"{err.detail} (committed on {list(committed)} before it failed; not on {left})",
                       err.engines)


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


def _pause_and_begin(engine: EngineAdapter, mode: str, version: str, timeout_s: float) -> None:
    """Pause generation and open a versioned update session: one request where the engine takes both."""
    both = capable(engine, PAUSE_AND_BEGIN, PausesAndBegins)
    if both is not None:
        both.pause_and_begin(mode, version, timeout_s)
        return
    engine.pause(mode)
    engine.begin_update(version, timeout_s)


def _check_formats(engines: Sequence[EngineAdapter], quantize: BlockFP8 | None) -> None:
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


def _memory(engine: EngineAdapter) -> MemoryEngine:
    return require(engine, RELEASE_MEMORY, MemoryEngine, "release_memory")


@dataclass(frozen=True)
class _Job:
    """What one call is about: the model's config, spec and source."""

    cfg: Any
    spec: ModelSpec
    source: Source

    @classmethod
    def of(cls, model_chunks: Any, hf_config: Any) -> _Job:
        cfg = load_hf_config(hf_config)
        return cls(cfg, model_spec(cfg), as_source(model_chunks))


class _AdapterOptions(TypedDict, total=False):
    """What every adapter made from a URL is given (``fp8`` and ``model_path`` only where stated)."""

    api_key: str | None
    timeout_s: float
    group_name: str
    fp8: BlockFP8
    model_path: str


class WeightSync:
    """A lasting connection from a trainer to its engines: connect once, ``update`` many times.

    Create and call it on every trainer rank. ``engines``: engine adapters (:class:`SGLangEngine`,
    :class:`ReferenceEngine`, ...) or URLs, whose engine is then ``engine`` (``"auto"``: detected by
    asking it, on the first update). ``quantize``: the layout the update sends (block FP8, or None:
    unquantized). ``engine_fp8`` / ``engine_model_path``: the layout the engines given by URL serve, stated
    where they do not report it (SGLang, vLLM, LMDeploy), as the adapters' ``fp8=`` / ``model_path=`` (the
    served model's directory, whose config.json's ``quantization_config`` says it).

    ``delta``: after a first full update, each bucket goes as the words that changed since the engines' last
    committed update (:mod:`weightstream.sinks.delta` says when an update is full instead), and every update is
    checked (each engine rank's checksum of each bucket's bytes against the trainer's; a mismatch aborts the
    update and sends it again, full). ``snapshot``: where the sender keeps its copy of the bytes the engines hold
    (``"device"`` or pinned ``"host"`` memory; 2 GB per billion bf16 parameters). ``full_every``: every N-th
    update is full.
    """

    def __init__(self, engines: EngineAdapter | str | Sequence[EngineAdapter | str], *, transport: str = "auto",
                 engine: str = "auto", colocated: bool | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 checksums: bool = False,
                 timeout_s: float = 60.0, master_address: str = "127.0.0.1", master_port: int | None = None,
                 backend: str | None = None, pause_mode: str = "abort", api_key: str | None = None,
                 group_name: str = "weightstream", reuse_buffers: bool = True, metadata_ahead: bool = True,
                 direct: bool = True, quantize: BlockFP8 | None = None, engine_fp8: BlockFP8 | None = None,
                 engine_model_path: str | None = None, delta: bool = False, full_every: int | None = None,
                 snapshot: str = "device"):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not engines:
            raise ValueError("no engines given")
        if engine != "auto" and engine not in ADAPTERS:
            raise ValueError(f"unknown engine {engine!r}; known: auto, {', '.join(sorted(ADAPTERS))}")
        self._given = engines_list(engines)
        self._engine_kind = engine
        self._adapter_options = _AdapterOptions(api_key=api_key, timeout_s=timeout_s, group_name=group_name)
        if engine_fp8 is not None:
            self._adapter_options["fp8"] = engine_fp8
        if engine_model_path is not None:
            self._adapter_options["model_path"] = engine_model_path
        self.engines: list[EngineAdapter] = []  # made by _resolve_engines on the first update
        self.transport, self.colocated, self.bucket_bytes = transport, colocated, bucket_bytes
        self.reuse_buffers = reuse_buffers  # pack into two buffers kept with the plan (stream_hf_weights)
        # Where the engines take it (``broadcast_ahead``, ``ipc_ahead``): the metadata of every bucket in one
        # request; False: one request per bucket (what every engine takes).
        self.metadata_ahead = metadata_ahead
        # IPC, where the engine offers its weights (the reference engine at TP 1): the trainer writes each
        # tensor straight into them, one copy; False: into buffers the engine copies out of (two copies).
        self.direct = direct
        # Block FP8: the weights the family declares FP8 leave quantized; every engine must serve that layout.
        self.quantize = quantize
        self.checksums, self.timeout_s, self.pause_mode = checksums, timeout_s, pause_mode
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.sinks: dict[str, Sink] = {}  # one per transport used, kept across updates (groups are made once)
        self.updates = 0
        self.released: list[str] = []  # memory the engines gave up (release_memory), re-created by the next update
        if full_every is not None and not delta:
            raise ValueError("full_every applies to delta updates (delta=True)")
        self.delta = DeltaTracker(Snapshot(snapshot), full_every) if delta else None
        self._reshard = False  # the last decision's: P2P sinks reshard (Decision.reshard)

    def _make_sink(self, kind: str, topology: Topology) -> Sink:
        sink = self.sinks.get(kind)
        if sink is not None:
            return sink
        other = {"broadcast": "p2p", "p2p": "broadcast"}.get(kind)
        # Both join the engines under one group name: one of them at a time. Where the new sink's group
        # would be the same (trainer and engine at TP 1), it takes the other's over instead of forming it again.
        previous = self.sinks.pop(other) if other in self.sinks else None
        sink = self._new_sink(kind, topology)
        if previous is not None and not (isinstance(previous, PipelinedSink) and isinstance(sink, PipelinedSink)
                                         and previous.hand_over(sink)):
            previous.disconnect()
        self.sinks[kind] = sink
        return sink

    def _new_sink(self, kind: str, topology: Topology) -> Sink:
        if kind == "ipc":
            return IPCSink(self.engines[0], checksums=self.checksums, timeout_s=self.timeout_s,
                           ahead=self.metadata_ahead, direct=self.direct,
                           delta=self.delta.snapshot if self.delta else None)
        if kind == "p2p" and self._reshard:
            return ReshardSink(self.engines[0], topology, master_address=self.master_address,
                               master_port=self.master_port, backend=self.backend, timeout_s=self.timeout_s,
                               checksums=self.checksums, delta=self.delta.snapshot if self.delta else None)
        if kind == "p2p":
            return P2PSink(self.engines, topology, master_address=self.master_address,
                           master_port=self.master_port, backend=self.backend, timeout_s=self.timeout_s,
                           checksums=self.checksums, delta=self.delta.snapshot if self.delta else None)
        return BroadcastSink(self.engines, master_address=self.master_address, master_port=self.master_port,
                             backend=self.backend, timeout_s=self.timeout_s, checksums=self.checksums,
                             ahead=self.metadata_ahead, delta=self.delta.snapshot if self.delta else None)

    def update(self, model_chunks: nn.Module | Sequence[nn.Module], hf_config: Any, *,
               weight_version: str | None = None) -> UpdateReport:
        """One update; call on every trainer rank. On failure every rank raises the same error (an
        :class:`UpdateError` naming the phase and the engines, or the :class:`ConversionError` that
        stopped the stream), the engines' sessions are aborted, the group is torn down on both sides,
        generation resumes, and it all ends within ``1.2 * timeout_s + 5`` seconds of the wait that
        failed. The phases: decide (and pause), open, transfer, (delta mode: check,) commit, resume. With
        ``delta``, an update whose check finds a mismatch is aborted (the engines put their weights back) and
        done again in full; its report says what was found."""
        start = time.perf_counter()
        job = _Job.of(model_chunks, hf_config)
        self.updates += 1
        version = weight_version if weight_version is not None else str(self.updates)
        report, mismatch = self._update_once(job, version)
        if mismatch is not None:  # the same on every rank: the tracker forced the next update full
            log.warning("delta update %s failed its check (%s): updating again, in full", version, mismatch)
            report, _ = self._update_once(job, version)
            if report.delta is not None:
                report.delta.mismatch = mismatch
        report.seconds["total"] = time.perf_counter() - start
        return report

    def _update_once(self, job: _Job, version: str) -> tuple[UpdateReport, str | None]:
        """One attempt: its report, and what the delta check found (None: the update is committed)."""
        seconds: dict[str, float] = {}
        decision = self._decide(job, version, seconds)
        report = UpdateReport(decision.transport, decision.reason, decision.mode, engines=self._urls())
        err, opened = self._open(job, decision, seconds, report)
        if opened is not None:
            err = self._transfer(*opened, err, report, seconds)
        failure, mismatch = _first_error(err), None
        if failure is None and opened is not None:
            opened[0].share_digests()  # every rank: the check below needs what each engine rank's senders sent
        if failure is None and _rank() == 0:
            failure, mismatch = self._check_delta(report, seconds)
            if failure is None and mismatch is None:
                failure, resumed = self._commit(version, seconds)
                if failure is None and not resumed:
                    self._resume(seconds)
                if failure is None and self.delta is not None and report.delta is not None:
                    self.delta.committed(self.engines, version, report.delta.full)
        failure, mismatch, delta = _share((failure, mismatch, report.delta))
        report.delta = delta  # rank 0 decides and checks deltas; every rank reports what it found
        if failure is not None:
            if self.delta is not None:
                self.delta.force_full(f"the last update failed ({type(failure).__name__})")
            self._fail()
            raise failure
        if mismatch is None:
            self.released = []
        report.weight_version = version
        report.seconds = seconds
        return report, mismatch

    def _begin_delta(self, decision: Decision, stream: BucketStream, report: UpdateReport) -> BaseException | None:
        """With ``delta``: rank 0 decides full or deltas for this update, and every rank readies its snapshot for
        it (in per-rank mode every TP rank encodes its own buckets)."""
        if self.delta is None:
            return None
        decided: tuple[bool, bool] | BaseException | None = None
        if _rank() == 0:
            try:
                report.delta = self.delta.begin(self.engines, decision.transport, stream.metadata_digest(),
                                                weights_released="weights" in self.released)
                decided = (self.delta.snapshot.full, self.delta.snapshot.active)
            except Exception as exc:  # noqa: BLE001 — the stream still runs on every rank, then this is raised
                decided = _as_update_error("delta", exc, self._urls())
        decided = _share(decided)
        if isinstance(decided, BaseException):
            return decided
        if _rank() != 0 and isinstance(decided, tuple):
            self.delta.snapshot.begin(*decided)
        return None

    def _check_delta(self, report: UpdateReport, seconds: dict[str, float]) -> tuple[BaseException | None, str | None]:
        """Rank 0, before the commit of a delta-mode update: the engines' checksums of what they applied against
        the trainer's. A mismatch aborts the sessions (the engines put their weights back) and forces the next
        update full; returned, said in one line."""
        if self.delta is None or report.delta is None or not report.delta.encoded:
            return None, None
        t = time.perf_counter()
        self.delta.sent(report.delta)
        try:
            problems = self.delta.check(self.engines)
        except Exception as exc:  # noqa: BLE001 — shared with every rank
            return _as_update_error("delta check", exc, self._urls()), None
        seconds["check"] = time.perf_counter() - t
        if not problems:
            report.delta.checked = True
            return None, None
        mismatch = "; ".join(problems)
        self.delta.force_full(f"the check of the last attempt found: {mismatch}")
        # An engine that cannot roll back holds the mismatched bytes: it stays paused until the full update.
        self._abort_sessions(resume_stale=False)
        return None, mismatch

    def _urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _decide(self, job: _Job, version: str | None, seconds: dict[str, float]) -> Decision:
        """Rank 0 asks the engines and decides; for an update (``version``) it also pauses them and opens
        their sessions. Every rank gets the decision, or raises the same error."""
        self._resolve_engines()
        decided: Decision | BaseException | None = None
        if _rank() == 0:
            t = time.perf_counter()
            try:
                kind, reason = choose_transport(self.transport, self.engines, job.source.topology, job.spec,
                                                self.colocated, p2p_source=job.source.per_rank_senders)
                _check_formats(self.engines, self.quantize)
                decided = Decision(kind, reason, any(e.info().can(SINGLE_DTYPE) for e in self.engines),
                                   kind == "p2p" and reshards(self.engines))
                if version is not None:
                    self._pause(version)
            except Exception as exc:  # noqa: BLE001 — shared with every rank below
                if version is not None:
                    self._abort_sessions()
                decided = _as_update_error("connect", exc, self._urls())
            if version is not None:
                seconds["pause"] = time.perf_counter() - t
        decided = _share(decided)
        if isinstance(decided, BaseException):
            raise decided
        if not isinstance(decided, Decision):
            raise TypeError(f"rank 0 decided {decided!r}")
        self._reshard = decided.reshard
        return decided

    def _pause(self, version: str) -> None:
        """Rank 0: pause generation and open every engine's session (weights released by :meth:`release_memory`
        are re-created first, before the update writes into them)."""
        if "weights" not in self.released:
            for e in self.engines:
                _pause_and_begin(e, self.pause_mode, version, self.timeout_s)
            return
        for e in self.engines:
            e.pause(self.pause_mode)
        for e in self.engines:
            _memory(e).resume_memory(["weights"])
        for e in self.engines:
            e.begin_update(version, self.timeout_s)

    def _stream(self, job: _Job, decision: Decision) -> BucketStream:
        return stream_hf_weights(job.source, job.cfg, bucket_bytes=self.bucket_bytes, mode=decision.mode,
                                 align=decision.align, split_dtypes=decision.one_dtype,
                                 reuse_buffers=self.reuse_buffers, quantize=self.quantize)

    def _open(self, job: _Job, decision: Decision, seconds: dict[str, float], report: UpdateReport | None = None,
              ) -> tuple[BaseException | None, tuple[Sink, BucketStream] | None]:
        """Every rank: the sink (kept across updates), the stream, (with ``delta``, on rank 0: full or deltas,
        before the sink opens) and the sink opened on it. A failure is kept, not raised: the stream still runs
        on this rank so that no other rank waits on it."""
        sink: Sink | None = None
        stream: BucketStream | None = None
        try:
            sink = self._make_sink(decision.transport, job.source.topology)
            stream = self._stream(job, decision)
            failed = self._begin_delta(decision, stream, report) if report is not None else None
            if failed is not None:
                return failed, _opened(sink, stream)
            t = time.perf_counter()
            sink.open(stream)
            seconds["connect"] = time.perf_counter() - t
        except BaseException as exc:  # noqa: BLE001
            return _as_update_error("group", exc, self._urls()), _opened(sink, stream)
        return None, _opened(sink, stream)

    def _transfer(self, sink: Sink, stream: BucketStream, err: BaseException | None, report: UpdateReport,
                  seconds: dict[str, float]) -> BaseException | None:
        """Every rank streams every bucket into the sink; a failing rank keeps joining the collectives
        (drains) so nobody hangs. The first failure is returned."""
        t = time.perf_counter()
        phase = "transfer"
        try:
            for bucket in stream:  # iterated to the end even after a failure: the gathers need every rank
                phase = f"bucket {bucket.index}"
                if err is None:
                    try:
                        sink.send(bucket)
                    except BaseException as exc:  # noqa: BLE001
                        err = _as_update_error(phase, exc, self._urls())
            if err is None:
                sink.close()
        except BaseException as exc:  # noqa: BLE001
            err = err or _as_update_error(phase, exc, self._urls())
        _fill_report(report, stream, sink.delivery())
        seconds["transfer"] = time.perf_counter() - t
        seconds["transfer:pack"] = stream.stats.seconds  # of which: this rank making the buckets
        waited = sink.delivery().waited_s
        if waited is not None:
            seconds["transfer:wait"] = waited  # and waiting for the engine's answers
        return err

    def _commit(self, version: str, seconds: dict[str, float]) -> tuple[BaseException | None, bool]:
        """Rank 0: every engine commits (and reports ``version``) and memory released before is re-created; and
        whether generation resumed with the commit (one request, where every engine takes both and nothing
        comes between)."""
        t = time.perf_counter()
        rest = [tag for tag in self.released if tag != "weights"]
        together = not rest and all(capable(e, COMMIT_AND_RESUME, CommitsAndResumes) is not None for e in self.engines)
        committed: list[str] = []
        try:
            prepared = self._prepare_commits(version)
            for e in sorted(self.engines, key=lambda e: e.url in prepared):  # the prepared ones last
                reported = (implementing(e, COMMIT_AND_RESUME, CommitsAndResumes).commit_and_resume() if together
                            else e.commit_update())
                committed.append(e.url)
                if reported != version:
                    raise UpdateError("commit", f"engine {e.url} reports weight version {reported!r}, expected "
                                      f"{version!r}", self._urls())
            for e in self.engines if rest else ():
                _memory(e).resume_memory(rest)
        except Exception as exc:  # noqa: BLE001 — shared with every rank
            return _committed_on(_as_update_error("commit", exc, self._urls()), committed, self._urls()), False
        seconds["commit"] = time.perf_counter() - t
        seconds["resume"] = 0.0  # with the commit, where ``together``
        return None, together

    def _prepare_commits(self, version: str) -> set[str]:
        """Rank 0, updating several engines: the first phase of the commit (:data:`PREPARE_COMMIT`) on each that
        takes it, before any engine commits: what a commit could fail on fails here, while every session can
        still be aborted (the engines put their last committed weights back). The URLs of the engines prepared
        (committed last: an engine that cannot prepare commits while they are still restorable)."""
        if len(self.engines) < 2:
            return set()
        preparing = [p for e in self.engines if (p := capable(e, PREPARE_COMMIT, PreparesCommits)) is not None]
        wrong = {p.url: v for p in preparing if (v := p.prepare_commit()) != version}
        if wrong:
            raise UpdateError("commit", f"engines would serve weight versions {wrong}, expected {version!r}; none "
                              "committed", self._urls())
        return {p.url for p in preparing}

    def _resume(self, seconds: dict[str, float]) -> None:
        """Rank 0: generation resumes on every engine (best effort: the update is committed)."""
        t = time.perf_counter()
        self._resume_quietly(self.timeout_s)
        seconds["resume"] = time.perf_counter() - t

    def prepare(self, model_chunks: nn.Module | Sequence[nn.Module], hf_config: Any) -> str:
        """What an update needs before its first bytes, done now: call it on every trainer rank once the model
        and the engines are up (before training starts, say). The engines are asked what they are, the
        transport is chosen, the stream's plan (table, buckets, copy programs, the kept buffers and the batched
        copies into them; on a GPU the copy kernel compiled, and with ``delta`` the word kernels) is made and kept,
        by broadcast or P2P every bucket is packed once (sending nothing: what a first pack compiles is compiled),
        and the group to the engines is formed and, where they take it, its connections made by a first, tiny
        transfer; the first :meth:`update` then costs about what a later one does (by IPC, where the trainer may
        write straight into the engine's weights, nothing is packed outside an update). The engines keep serving
        meanwhile (nothing is paused). Returns the transport; raises on every rank what the first update would have
        raised."""
        job = _Job.of(model_chunks, hf_config)
        decision = self._decide(job, None, {})
        err: BaseException | None = None
        try:
            stream = self._stream(job, decision)
            stream.metadata_digest()  # every bucket's copy program, made and kept with the plan
            sink = self._make_sink(decision.transport, job.source.topology)
            sink.prepare(stream)  # IPC: the engine learns the plan and maps the kept buffers (first: on the CPU,
            stream.prepare_copies()  # sharing a buffer moves it into shared memory); then the copies into them
            if self.delta is not None:  # the word kernels compiled, for the first delta (on a GPU)
                warm_kernels(stream.device, {word_size(extent(ms), (m.dtype.itemsize for m in ms))
                                             for ms in map(stream.bucket_metas, range(len(stream)))})
            stream.warm_casts()  # on a GPU with block FP8, the cast kernel compiled (whatever the transport)
            if decision.transport != "ipc":  # (IPC may write into the engine's weights, on some ranks only)
                stream.rehearse()  # every bucket packed once (on a GPU, the block-FP8 kernel compiled), none sent
            sink.connect()  # (and the group's first transfer made, where the engines take it)
        except BaseException as exc:  # noqa: BLE001
            err = _as_update_error("group", exc, self._urls())
        failure = _first_error(err)
        if failure is not None:
            self._teardown()
            raise failure
        return decision.transport

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Between rollouts, on every trainer rank: pause generation and have the engines free their memory
        (``tags``: SGLang's ``weights``, ``kv_cache``, ``cuda_graph``; all by default) while the trainer
        trains. The next :meth:`update` re-creates the weights before streaming into them and the rest
        after committing, then resumes generation; the engine serves nothing until then."""
        self._resolve_engines()
        tags = list(tags) if tags else ["weights", "kv_cache", "cuda_graph"]
        ipc = self.sinks.get("ipc")
        if isinstance(ipc, IPCSink) and "weights" in tags:
            ipc.forget_targets()  # the engine's weights mapped here would keep their memory from being freed
        err: Any = None
        if _rank() == 0:
            try:
                unable = [e.url for e in self.engines if not e.info().can(RELEASE_MEMORY)]
                if unable:
                    raise ValueError(f"engines {unable} cannot release their memory")
                for e in self.engines:
                    e.pause(self.pause_mode)
                    _memory(e).release_memory(tags)
            except Exception as exc:  # noqa: BLE001 — shared with every rank below
                err = _as_update_error("release_memory", exc, self._urls())
        err = _share(err)
        if err is not None:
            raise err
        self.released = sorted(set(self.released) | set(tags))

    def _resolve_engines(self) -> None:
        """Adapters for engines given by URL: rank 0 asks each engine what it is (``engine="auto"``),
        every rank makes the same adapters."""
        if self.engines:
            return
        urls = [u for u in self._given if isinstance(u, str)]
        kinds: Any = None
        if urls and _rank() == 0:
            try:
                kinds = [self._engine_kind if self._engine_kind != "auto" else
                         detect(u, api_key=self._adapter_options.get("api_key"), timeout_s=self.timeout_s)
                         for u in urls]
            except Exception as exc:  # noqa: BLE001 — shared with every rank below
                kinds = _as_update_error("connect", exc, urls)
        if urls:
            kinds = _share(kinds)
        if isinstance(kinds, BaseException):
            raise kinds
        made = iter(make_adapter(k, u, **self._adapter_options) for k, u in zip(kinds or [], urls, strict=True))
        self.engines = [next(made) if isinstance(e, str) else e for e in self._given]

    def _abort_sessions(self, seconds: float | None = None, resume_stale: bool = True) -> None:
        """Close every engine's session without committing, then resume generation; within ``seconds``
        (the cleanup budget by default), best effort: an engine that cannot answer gives its session
        up by itself after the bound it was given at ``begin``. ``resume_stale`` False: an engine that does not
        declare ``rollback`` (what the session loaded stays) is left paused, for an update that follows at once."""
        deadline = Deadline(cleanup_budget(self.timeout_s) if seconds is None else seconds)
        pool = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="ws-abort")

        def abort_then_resume(e) -> None:
            try:
                e.abort_update(timeout_s=deadline.remaining(0.5))
            except Exception as exc:  # noqa: BLE001
                log.warning("could not abort the update session on %s: %s", e.url, exc)
            try:
                if resume_stale or e.info().can(ROLLBACK):
                    e.resume(timeout_s=deadline.remaining(0.5))
            except Exception as exc:  # noqa: BLE001
                log.warning("could not resume generation on %s: %s", e.url, exc)

        futures = [pool.submit(abort_then_resume, e) for e in self.engines]
        wait(futures, timeout=deadline.remaining())
        pool.shutdown(wait=False, cancel_futures=True)

    def _fail(self) -> None:
        """After a failed update, on every rank: the group is left (both sides) while rank 0 aborts the
        engines' sessions and resumes generation, all within the cleanup budget."""
        aborting = None
        if _rank() == 0:
            aborting = threading.Thread(target=self._abort_sessions, name="ws-abort", daemon=True)
            aborting.start()
        try:
            self._teardown()
        finally:
            if aborting is not None:
                aborting.join(cleanup_budget(self.timeout_s))

    def _resume_quietly(self, timeout_s: float) -> None:
        for e in self.engines:
            try:
                e.resume(timeout_s=timeout_s)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not resume generation on %s: %s", e.url, exc)

    def _teardown(self) -> None:
        """After a failure: every sink is dropped (its group torn down), so the next update starts clean."""
        sinks, self.sinks = list(self.sinks.values()), {}
        for sink in sinks:
            try:
                sink.abort()
            except Exception as exc:  # noqa: BLE001 — best effort: the peer may be gone
                log.warning("could not tear down the %s sink: %s", sink.name, exc)

    def close(self) -> None:
        """Tear down the weight-update groups (engines keep their weights)."""
        sinks, self.sinks = list(self.sinks.values()), {}
        for sink in sinks:
            sink.disconnect()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _opened(sink: Sink | None, stream: BucketStream | None) -> tuple[Sink, BucketStream] | None:
    return None if sink is None or stream is None else (sink, stream)


def _fill_report(report: UpdateReport, stream: BucketStream, delivery: Delivery) -> None:
    report.buckets, report.tensors, report.bytes = stream.stats.buckets, stream.stats.tensors, stream.stats.bytes
    report.gathers = stream.stats.gathers
    report.planned, report.copies_made = stream.stats.planned, stream.stats.copy_programs
    report.metadata_ahead, report.direct = delivery.metadata_ahead, delivery.direct
    report.formed_group = delivery.formed_group
    if delivery.tensors is not None:
        report.tensors = delivery.tensors


def engines_list(engines: EngineAdapter | str | Sequence[EngineAdapter | str]) -> list[EngineAdapter | str]:
    """One engine (its URL or adapter) or several, as a list: a string is one URL, never a sequence of them."""
    if isinstance(engines, str) or not isinstance(engines, Sequence):
        return [engines]
    return list(engines)


def update_weights(model_chunks: nn.Module | Sequence[nn.Module], hf_config: Any,
                   engines: EngineAdapter | str | Sequence[EngineAdapter | str], *, transport: str = "auto",
                   weight_version: str | None = None, **options) -> UpdateReport:
    """One update: pause, connect, stream, commit, flush the engines' caches, resume, disconnect. Call on every
    trainer rank. For repeated updates keep a :class:`WeightSync` instead (the group is made once)."""
    with WeightSync(engines, transport=transport, **options) as sync:
        return sync.update(model_chunks, hf_config, weight_version=weight_version)
