"""What an update needs from an inference engine, whichever engine it is.

A sink moves bytes (a broadcast, a send per TP rank, an IPC handle) and calls the engine's adapter for
everything else: telling the engine a bucket is coming and what is in it, joining and leaving the group the
bytes travel through, opening, committing and aborting a versioned update, pausing and resuming generation,
releasing and resuming memory. ``update.py`` picks a transport from the adapter's :class:`EngineInfo`
(sizes, GPUs, capabilities), never from an engine's name. Each engine is one adapter module; adding an
engine adds one module and touches no sink.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from weightstream.converters.fp8 import BlockFP8, block_fp8_of
from weightstream.errors import WeightstreamError
from weightstream.streaming.bucket import Bucket, TensorMeta
from weightstream.streaming.delta import DeltaHeader
from weightstream.streaming.reshard import EngineLayout
from weightstream.wire.frames import Plan

__all__ = [
    "BROADCAST", "IPC", "P2P", "RESHARD", "ROLLBACK", "RELEASE_MEMORY", "SINGLE_DTYPE", "BROADCAST_AHEAD", "P2P_AHEAD",
    "IPC_AHEAD", "COMMIT_AND_RESUME", "PAUSE_AND_BEGIN", "PREPARE_COMMIT", "DELTA", "DELTA_AHEAD", "WARM_GROUP",
    "EngineError", "EngineUnreachable", "EngineInfo", "StatedFormat", "stated_format", "describe_format",
    "settle_format", "GroupSpec", "RankBucket", "EngineAdapter", "GroupEngine", "BroadcastEngine", "P2PEngine",
    "ReshardEngine", "IPCEngine", "MemoryEngine", "BroadcastAheadEngine", "P2PAheadEngine", "IPCAheadEngine",
    "CommitsAndResumes", "PreparesCommits", "PausesAndBegins", "DeltaChecks", "DeltaEngine", "CAPABILITY_PROTOCOLS",
    "implementing", "capable", "require", "HTTPEngine"
]


# Capabilities an engine may declare.
BROADCAST = "broadcast"  # receives a bucket's flat buffer by a broadcast over a joined group
IPC = "ipc"  # receives a bucket's buffer as a CUDA IPC handle / shared-memory file
P2P = "p2p"  # each engine TP rank receives its own per-rank bucket from trainer TP rank r (send/recv)
# P2P into an engine of another layout: it declares how it splits each tensor (EngineLayout), and each engine
# rank takes the pieces of its part from the trainer ranks that hold them (weightstream.streaming.reshard)
RESHARD = "reshard"
ROLLBACK = "rollback"  # an aborted update puts the last committed weights back
RELEASE_MEMORY = "release_memory"  # frees weights / KV cache while the trainer runs, re-creates them after
SINGLE_DTYPE = "single_dtype"  # every bucket must hold tensors of one dtype (the planner cuts them so)
# takes the metadata of every bucket of an update in one request, then receives the broadcasts back to back
# (no HTTP round trip between two buckets on the wire)
BROADCAST_AHEAD = "broadcast_ahead"
# takes what each of its ranks receives in every per-rank (P2P) bucket of an update in one request, then receives
# them back to back (no HTTP round trip between two buckets on the wire)
P2P_AHEAD = "p2p_ahead"
# takes the metadata of every bucket of a colocated update in one request, then per bucket one small frame on
# a control channel per TP rank (a kept buffer's handle is opened once; CUDA events instead of synchronising)
IPC_AHEAD = "ipc_ahead"
COMMIT_AND_RESUME = "commit_and_resume"  # commits an update and resumes generation in one request
PAUSE_AND_BEGIN = "pause_and_begin"  # pauses generation and opens an update session in one request
# a commit in two phases: ``prepare_commit`` does whatever the commit could fail on and keeps the session
# restorable, so that a trainer updating several engines commits none of them until every one has prepared
PREPARE_COMMIT = "prepare_commit"
# applies delta buckets (:mod:`weightstream.streaming.delta`) to the bytes of each bucket it holds from the last
# committed update, and reports what it holds and the checksum of what it applied
DELTA = "delta"
# with ``broadcast_ahead`` or ``p2p_ahead``, takes a delta-mode update's buckets ahead too: the metadata of every
# bucket in one request, then per bucket its delta header on the wire (``DeltaHeader.as_words``: six int64 words)
# right before its payload, from the same sender (no HTTP round trip per bucket)
DELTA_AHEAD = "delta_ahead"
# runs a tiny transfer of the group's kind (``GroupSpec.warm``) right after joining a group, as the trainer does, so
# that the first update does not pay for the group's connections (NCCL makes them on a group's first use)
WARM_GROUP = "warm_group"


class EngineError(WeightstreamError):
    def __init__(self, url: str, step: str, detail: str):
        self.url, self.step, self.detail = url, step, detail
        super().__init__(f"engine {url}: {step} failed: {detail}")

    def __reduce__(self):
        return (type(self), (self.url, self.step, self.detail))


class EngineUnreachable(EngineError):
    """The engine could not be reached, or did not answer in time: what it did with the request is unknown (an
    :class:`EngineError` of any other kind is the engine's answer)."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, as far as an update cares."""

    engine: str
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    gpu_uuids: tuple[str, ...] = ()
    capabilities: frozenset[str] = field(default_factory=frozenset)
    fp8: BlockFP8 | None = None  # the block-FP8 layout of the engine's model (None: not quantized, or not said)
    # The FP8 method the engine names for the weights it holds in float8 (``"fp8"``), whether or not it reports
    # their layout; None where it holds none (an engine that quantizes unquantized updates itself names none).
    quantization: str | None = None
    # Where ``fp8`` was stated by the user (:class:`StatedFormat`): what that statement contradicts in what the
    # engine reports, one line each (an update refuses such an engine, naming them).
    fp8_conflicts: tuple[str, ...] = ()

    def can(self, capability: str) -> bool:
        return capability in self.capabilities


@dataclass(frozen=True)
class StatedFormat:
    """The weight layout of an engine's model as its user states it, for engines that do not report it
    (SGLang, vLLM, LMDeploy): block FP8 in ``fp8``'s layout, or unquantized (``fp8`` None, from a model whose
    ``config.json`` has no ``quantization_config``). ``source`` says where the statement came from."""

    fp8: BlockFP8 | None
    source: str


def stated_format(fp8: BlockFP8 | None, model_path: str | Path | None) -> StatedFormat | None:
    """What an adapter's ``fp8=`` and ``model_path=`` state (None: neither given). ``model_path``: the served
    model's directory (or its ``config.json``), whose ``quantization_config`` says the layout. Raises one
    ``ValueError`` where the model's config cannot be read, names a quantization other than block FP8, or
    disagrees with ``fp8``."""
    if model_path is None:
        return None if fp8 is None else StatedFormat(fp8, f"fp8={fp8}")
    path = Path(model_path)
    config_file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model_path {str(model_path)!r}: cannot read the served model's config.json "
                         f"({exc})") from None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    from_config = block_fp8_of(qc if isinstance(qc, dict) else None)
    problems = []
    if qc and from_config is None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        problems.append(f"its quantization_config names {method!r} without a weight_block_size: weightstream "
                        "sends block FP8 or unquantized weights only")
    if fp8 is not None and fp8 != from_config:
        problems.append(f"it declares {describe_format(from_config)}, but fp8={fp8} was stated")
    if problems:
        raise ValueError(f"the model at {str(config_file)!r}: " + "; ".join(problems))
    return StatedFormat(from_config, f"the quantization_config of {config_file}")


def describe_format(fp8: BlockFP8 | None) -> str:
    return "unquantized weights" if fp8 is None else f"block FP8 {fp8.block} ({fp8.scale_fmt} scales)"


def settle_format(stated: StatedFormat | None, reported: BlockFP8 | None, method: str | None, *,
                  reports_layout: bool, names_fp8_method: bool) -> tuple[BlockFP8 | None, tuple[str, ...]]:
    """An engine's block-FP8 layout (``EngineInfo.fp8``) and what a statement contradicts in its report.

    ``reported``: the layout the engine reports where it reports one (``reports_layout``: a
    ``quantization_config`` in its reply, null for an unquantized model). ``method``: the FP8 method it names
    (``EngineInfo.quantization``) or any other quantization method it names. ``names_fp8_method``: the engine
    always names ``fp8`` for a block-FP8 checkpoint (vLLM), so naming nothing contradicts a stated layout.
    Without a statement the engine's report stands (None where it says nothing)."""
    if stated is None:
        return reported, ()
    said = f"stated ({stated.source}): {describe_format(stated.fp8)}"
    if reports_layout:
        if reported != stated.fp8:
            return reported, (f"{said}, but the engine reports {describe_format(reported)}",)
        return reported, ()
    if stated.fp8 is not None and method not in ("fp8", None):
        return stated.fp8, (f"{said}, but the engine names quantization {method!r}",)
    if stated.fp8 is not None and method is None and names_fp8_method:
        return stated.fp8, (f"{said}, but the engine names no FP8 method (its model is not quantized)",)
    if stated.fp8 is None and method is not None:
        return stated.fp8, (f"{said}, but the engine names quantization {method!r}",)
    return stated.fp8, ()


@dataclass(frozen=True)
class GroupSpec:
    """One weight-update group: the trainer's sender is rank 0 and hosts the store at
    ``master_address:master_port``; this engine's TP rank r joins as ``rank_offset + r``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    timeout_s: float
    group_name: str
    # The first transfer every member runs on forming the group (:func:`weightstream.wire.groups.warm_group`:
    # "broadcast", or "sends" from each of the first ``warm_senders`` ranks to every other); "" for none. Given only
    # where every engine of the group declares :data:`WARM_GROUP`.
    warm: str = ""
    warm_senders: int = 1


@dataclass(frozen=True)
class RankBucket:
    """What one engine TP rank receives in a per-rank (P2P) bucket: from trainer rank ``src``,
    ``nbytes`` bytes laid out as ``metas`` (or, a delta, the payload that gives them)."""

    src: int
    metas: tuple[TensorMeta, ...]
    nbytes: int
    checksum: str | None = None
    delta: DeltaHeader | None = None  # a delta (:data:`DELTA`): ``nbytes`` of payload, encoded as it says
    # A resharded bucket (:data:`RESHARD`): the engine rank it is for (one engine rank may then hear several
    # trainer ranks, each piece placed in its whole tensor by its shard); None: the engine rank of its position.
    rank: int | None = None


@runtime_checkable
class EngineAdapter(Protocol):
    """One engine (all its ranks) as every update sees it: what it is, its generation, and versioned update
    sessions. What moves the bytes is a capability (below), declared by the engine in :class:`EngineInfo` and
    implemented by the adapter; :func:`capable` ties the two. Every call is bounded (``timeout_s`` of the
    adapter unless given) and raises :class:`EngineError` naming the engine and the step."""

    url: str
    group_name: str

    def info(self, refresh: bool = False) -> EngineInfo: ...

    def pause(self, mode: str = "abort") -> None: ...

    def resume(self, timeout_s: float | None = None) -> None: ...

    def begin_update(self, version: str | None, timeout_s: float | None = None) -> None: ...

    def commit_update(self) -> str | None:
        """Load what was received for good; returns the weight version the engine now reports."""

    def abort_update(self, timeout_s: float | None = None) -> None: ...


@runtime_checkable
class GroupEngine(EngineAdapter, Protocol):
    """Joins and leaves the process group that bytes travel through (:data:`BROADCAST`, :data:`P2P`)."""

    def join_group(self, spec: GroupSpec) -> None: ...

    def leave_group(self, timeout_s: float | None = None) -> None: ...


@runtime_checkable
class BroadcastEngine(GroupEngine, Protocol):
    """:data:`BROADCAST`: receives each bucket's flat buffer by a broadcast over the joined group."""

    def receive_broadcast(self, bucket: Bucket, checksum: str | None) -> None:
        """Tell the engine the bucket being broadcast now (it receives it and loads it)."""


@runtime_checkable
class P2PEngine(GroupEngine, Protocol):
    """:data:`P2P`: each engine TP rank receives its own per-rank bucket from trainer TP rank r."""

    def receive_p2p(self, index: int, ranks: Sequence[RankBucket]) -> None: ...


@runtime_checkable
class ReshardEngine(P2PEngine, Protocol):
    """:data:`RESHARD`: per-rank buckets into an engine of another layout; it declares how it holds each tensor."""

    def layout(self) -> EngineLayout:
        """How the engine splits the HF tensors over its ranks."""


@runtime_checkable
class IPCEngine(EngineAdapter, Protocol):
    """:data:`IPC`: receives each bucket as CUDA IPC handles / shared-memory files of the colocated ranks."""

    def encode_ipc(self, bucket: Bucket) -> Any:
        """This trainer rank's bucket as the engine's IPC payload (called on every colocated rank)."""

    def receive_ipc(self, index: int, payloads: Sequence[Any], checksums: Sequence[str | None] | None) -> None: ...


@runtime_checkable
class MemoryEngine(EngineAdapter, Protocol):
    """:data:`RELEASE_MEMORY`: frees weights / KV cache while the trainer runs, re-creates them after."""

    def release_memory(self, tags: Sequence[str] | None = None) -> None: ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...


@runtime_checkable
class BroadcastAheadEngine(EngineAdapter, Protocol):
    """:data:`BROADCAST_AHEAD`: the metadata of every bucket in one request, then the broadcasts back to back."""

    def receive_broadcast_ahead(self, buckets: Sequence[Sequence[TensorMeta]], timeout_s: float,
                                delta: bool = False) -> None:
        """The metadata of every bucket of this update, in order, before the first is broadcast; ``delta``
        (:data:`DELTA_AHEAD`): each bucket's delta header is broadcast right before its payload."""


@runtime_checkable
class P2PAheadEngine(EngineAdapter, Protocol):
    """:data:`P2P_AHEAD`: per bucket of an update, what each engine rank receives (one :class:`RankBucket` per rank),
    all in one request; then the buckets are sent back to back."""

    def receive_p2p_ahead(self, buckets: Sequence[Sequence[RankBucket]], timeout_s: float,
                          delta: bool = False) -> None:
        """``delta`` (:data:`DELTA_AHEAD`): each rank's bucket comes as its delta header, then its payload, from its
        ``src``."""


@runtime_checkable
class IPCAheadEngine(EngineAdapter, Protocol):
    """:data:`IPC_AHEAD`: a colocated update's plan announced once, then one small frame per bucket on a
    control channel per TP rank (:mod:`weightstream.wire`)."""

    def receive_ipc_ahead(self, plan: str, num_buckets: int, channels: Sequence[str], client: str,
                          timeout_s: float, delta: bool = False) -> None:
        """``delta``: every bucket comes as a delta payload (:class:`~weightstream.wire.frames.DeltaRecord`)."""

    def prepare_ipc_ahead(self, plan: str, num_buckets: int, channels: Sequence[str], client: str,
                          timeout_s: float) -> None: ...

    def release_ipc_buffers(self, client: str, timeout_s: float | None = None) -> None: ...

    def ipc_plan_frame(self, buckets: Sequence[Sequence[TensorMeta]]) -> Plan:
        """The layout of every bucket of the plan, as the engine reads it on the control channel."""


@runtime_checkable
class CommitsAndResumes(EngineAdapter, Protocol):
    """:data:`COMMIT_AND_RESUME`: commits an update and resumes generation in one request."""

    def commit_and_resume(self) -> str | None: ...


@runtime_checkable
class PreparesCommits(EngineAdapter, Protocol):
    """:data:`PREPARE_COMMIT`: the first phase of a commit; returns the version the commit will serve."""

    def prepare_commit(self) -> str | None: ...


@runtime_checkable
class PausesAndBegins(EngineAdapter, Protocol):
    """:data:`PAUSE_AND_BEGIN`: pauses generation and opens an update session in one request."""

    def pause_and_begin(self, mode: str, version: str | None, timeout_s: float | None = None) -> None: ...


@dataclass(frozen=True)
class DeltaChecks:
    """What a :data:`DELTA` engine applied in the open session: ``instance`` names the running engine (a
    restarted one names another), ``base`` what it held before (``instance/version`` of the last committed
    update whose buckets it keeps; None: none), ``buckets`` each bucket index's checksum of the bytes applied,
    per engine rank."""

    instance: str
    base: str | None
    buckets: dict[int, tuple[str, ...]]


@runtime_checkable
class DeltaEngine(EngineAdapter, Protocol):
    """:data:`DELTA`: takes buckets whose buffer is a delta against the bytes it holds of them (a broadcast
    bucket's :attr:`~weightstream.streaming.bucket.Bucket.delta`), keeps the bytes it applied, and reports them."""

    def delta_base(self) -> str | None:
        """``instance/version`` of the committed update whose bytes the engine holds (None: it holds none)."""

    def delta_checks(self) -> DeltaChecks:
        """What the open session applied (:class:`DeltaChecks`)."""


# What an adapter implements for each capability its engine may declare.
CAPABILITY_PROTOCOLS: dict[str, type] = {
    BROADCAST: BroadcastEngine, P2P: P2PEngine, RESHARD: ReshardEngine, IPC: IPCEngine, RELEASE_MEMORY: MemoryEngine,
    BROADCAST_AHEAD: BroadcastAheadEngine, IPC_AHEAD: IPCAheadEngine, P2P_AHEAD: P2PAheadEngine,
    COMMIT_AND_RESUME: CommitsAndResumes, PAUSE_AND_BEGIN: PausesAndBegins, PREPARE_COMMIT: PreparesCommits,
    DELTA: DeltaEngine,
}

_P = TypeVar("_P")


def implementing(engine: EngineAdapter, capability: str, protocol: type[_P]) -> _P:
    """``engine`` as ``protocol`` (what an adapter implements for ``capability``); an adapter that does not
    implement it raises, naming both. Asks the engine nothing."""
    if CAPABILITY_PROTOCOLS.get(capability) is not protocol:
        raise ValueError(f"capability {capability!r} is not served by {protocol.__name__}")
    if not isinstance(engine, protocol):
        raise TypeError(f"{type(engine).__name__} does not implement {protocol.__name__} (capability {capability!r})")
    return engine


def capable(engine: EngineAdapter, capability: str, protocol: type[_P]) -> _P | None:
    """``engine`` as ``protocol`` where its engine declares ``capability`` (asked once, see
    :meth:`EngineAdapter.info`), None where it does not. An engine that declares a capability its adapter does
    not implement is an error of the adapter (raised)."""
    if not engine.info().can(capability):
        return None
    return implementing(engine, capability, protocol)


def require(engine: EngineAdapter, capability: str, protocol: type[_P], why: str) -> _P:
    """``engine`` as ``protocol``; an engine that does not declare ``capability`` raises, saying ``why`` it is
    needed."""
    found = capable(engine, capability, protocol)
    if found is None:
        raise EngineError(engine.url, why, f"the engine does not declare {capability!r} "
                          f"(it declares {', '.join(sorted(engine.info().capabilities)) or 'nothing'})")
    return found


class HTTPEngine:
    """Bounded JSON-over-HTTP calls to one engine; the plumbing every HTTP adapter shares."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                 group_name: str = "weight_update_group", fp8: BlockFP8 | None = None,
                 model_path: str | Path | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.group_name = group_name
        # The layout of the served model as the user states it (``fp8=``, or the ``quantization_config`` of
        # ``model_path``'s config.json): what an engine that does not report its layout serves.
        self.stated = stated_format(fp8, model_path)
        self._info: EngineInfo | None = None
        self._server_info: dict | None = None  # what the engine said it is (each adapter asks in its own way)
        self._session = False  # a session this client opened and has not ended
        self._version: str | None = None  # the weight version of that session

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def request(self, method: str, path: str, body: Any = None, *, step: str | None = None,
                timeout_s: float | None = None) -> Any:
        step = step or path.strip("/")
        timeout = timeout_s or self.timeout_s
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                parsed = json.loads(detail)
                detail = parsed.get("message") or (parsed.get("error") or {}).get("message") or detail
            except (ValueError, AttributeError):
                pass
            raise EngineError(self.url, step, f"HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise EngineUnreachable(self.url, step,
                                    f"unreachable or no answer within {timeout:.0f} s ({reason})") from None
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = raw.decode(errors="replace")
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(self.url, step, reply.get("message", "success=false"))
        return reply

    def info(self, refresh: bool = False) -> EngineInfo:
        """What the engine is (each engine's adapter asks it in its own way)."""
        raise NotImplementedError

    def post(self, path: str, body: Any = None, **kw) -> Any:
        return self.request("POST", path, body if body is not None else {}, **kw)

    def get(self, path: str, **kw) -> Any:
        return self.request("GET", path, **kw)

    @property
    def tp_size(self) -> int:
        return self.info().tp_size
