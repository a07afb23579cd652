"""What an update needs from an inference engine, whichever engine it is.

A sink moves bytes (a broadcast, a send per TP rank, an IPC handle) and calls the engine's adapter for
everything else: telling the engine a bucket is coming and what is in it, joining and leaving the group the
bytes travel through, opening, committing and aborting a versioned update, pausing and resuming generation,
releasing and resuming memory. ``update.py`` picks a transport from the adapter's :class:`EngineInfo`
(sizes, GPUs, capabilities), never from an engine's name. Each engine is one adapter module; adding an
engine adds one module and touches no sink.

This module holds the interface only: the capabilities, the records its methods take and return, the
protocols, each method saying who calls it, when in an update and on which trainer ranks, and the one way a
sink reaches a capability's protocol (:func:`capable`, :func:`require`, :func:`implementing`). The HTTP
plumbing adapters share:
:mod:`weightstream.engines.http`; a user's statement of the model's block-FP8 layout:
:mod:`weightstream.engines.formats`.

An update, as :class:`~weightstream.update.WeightSync` runs it against one engine (every call here from
trainer rank 0 unless said otherwise): ``info`` (the transport is chosen); ``pause`` and ``begin_update`` (or
``pause_and_begin``); the sink's calls of the chosen capability per bucket (a group joined before the first
bucket by ``join_group``; the metadata ahead where declared); ``prepare_commit`` where several engines are
updated; ``commit_update`` (or ``commit_and_resume``); ``resume``. A failure: ``abort_update``, then ``resume``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from weightstream.errors import WeightstreamError
from weightstream.streaming.bucket import Bucket, TensorMeta
from weightstream.streaming.delta import DeltaHeader
from weightstream.streaming.reshard import EngineLayout
from weightstream.wire.fp8 import BlockFP8
from weightstream.wire.frames import Plan

__all__ = [
    "BROADCAST", "IPC", "P2P", "RESHARD", "ROLLBACK", "RELEASE_MEMORY", "SINGLE_DTYPE", "BROADCAST_AHEAD", "P2P_AHEAD",
    "IPC_AHEAD", "IPC_SESSION", "COMMIT_AND_RESUME", "PAUSE_AND_BEGIN", "PREPARE_COMMIT", "DELTA", "DELTA_AHEAD",
    "IPC_DELTA", "WARM_GROUP", "BROADCAST_PREPARE",
    "EngineError", "EngineUnreachable", "EngineInfo", "GroupSpec", "RankBucket", "EngineAdapter", "GroupEngine",
    "BroadcastEngine", "P2PEngine", "ReshardEngine", "IPCEngine", "MemoryEngine", "BroadcastAheadEngine",
    "P2PAheadEngine", "BroadcastPrepareEngine", "IpcSession", "PendingAnswer", "IPCAheadEngine", "CommitsAndResumes",
    "PreparesCommits", "PausesAndBegins", "DeltaChecks", "DeltaEngine", "CAPABILITY_PROTOCOLS", "implementing",
    "capable", "require",
]

T_co = TypeVar("T_co", covariant=True)


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
# takes a broadcast plan (every bucket's metadata) before any update, outside a session, and makes what the update
# will load by ready then (copy programs, receive buffers, checks); the first update then sends the plan's key alone
BROADCAST_PREPARE = "broadcast_prepare"
# takes what each of its ranks receives in every per-rank (P2P) bucket of an update in one request, then receives
# them back to back (no HTTP round trip between two buckets on the wire)
P2P_AHEAD = "p2p_ahead"
# takes the metadata of every bucket of a colocated update in one request, then per bucket one small frame on
# a control channel per TP rank (a kept buffer's handle is opened once; CUDA events instead of synchronising)
IPC_AHEAD = "ipc_ahead"
# with ``ipc_ahead``, the update's request opens the session (pausing generation) before its buckets and commits it
# (resuming generation) after them, where every trainer rank's last frame lets it (:class:`IpcSession`): a colocated
# update in one request
IPC_SESSION = "ipc_session"
COMMIT_AND_RESUME = "commit_and_resume"  # commits an update and resumes generation in one request
PAUSE_AND_BEGIN = "pause_and_begin"  # pauses generation and opens an update session in one request
# a commit in two phases: ``prepare_commit`` does whatever the commit could fail on and keeps the session
# restorable, so that a trainer updating several engines commits none of them until every one has prepared
PREPARE_COMMIT = "prepare_commit"
# applies delta buckets (:mod:`weightstream.streaming.delta`) to the bytes of each bucket it holds from the last
# committed update, and reports what it holds and the checksum of what it applied (:class:`DeltaEngine`): by every
# transport it declares (broadcast, P2P; IPC where it declares ``ipc_ahead``, the deltas going ahead)
DELTA = "delta"
# with ``broadcast_ahead`` or ``p2p_ahead``, takes a delta-mode update's buckets ahead too: the metadata of every
# bucket in one request, then per bucket its delta header on the wire (``DeltaHeader.as_words``: six int64 words)
# right before its payload, from the same sender (no HTTP round trip per bucket)
DELTA_AHEAD = "delta_ahead"
# as ``delta``, but by IPC only, one request per bucket: :meth:`IPCEngine.encode_ipc` is given the bucket as the
# trainer's snapshot encodes it (its ``delta`` set, its buffer the payload) and :meth:`IPCEngine.receive_ipc` sends
# it; the engine reports as ``delta`` says (:class:`DeltaEngine`). Where an engine declares this and not ``delta``,
# its other transports take whole buckets only (SGLang with weightstream's loader: its broadcast is SGLang's own
# ``/update_weights_from_distributed``), and a delta-mode update by them is refused
IPC_DELTA = "ipc_delta"
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
    implemented by the adapter; :func:`capable` ties the two. Every call is
    bounded (``timeout_s`` of the adapter unless given) and raises :class:`EngineError` naming the engine and
    the step."""

    url: str
    group_name: str

    def info(self, refresh: bool = False) -> EngineInfo:
        """What the engine is: sizes, GPUs, capabilities, block-FP8 layout. Asked by the transport's choice
        before every update and by the sinks (trainer rank 0, or every rank of a resharding or delta sink); an
        adapter asks its engine once and answers from then on what it said, unless ``refresh``."""

    def pause(self, mode: str = "abort") -> None:
        """Trainer rank 0, first of an update (or before its memory is released): generation stops (``mode``:
        what becomes of the requests in flight, as the engine names it)."""

    def resume(self, timeout_s: float | None = None) -> None:
        """Trainer rank 0, last: generation resumes, after :meth:`commit_update` (or after
        :meth:`abort_update`, within ``timeout_s``)."""

    def begin_update(self, version: str | None, timeout_s: float | None = None) -> None:
        """Trainer rank 0, after :meth:`pause` and before the sink opens: a session that will serve
        ``version`` once committed; what the sink delivers goes into it."""

    def commit_update(self) -> str | None:
        """Trainer rank 0, once every rank's sink closed without error: load what was received for good;
        returns the weight version the engine now reports."""

    def abort_update(self, timeout_s: float | None = None) -> None:
        """Trainer rank 0, after a failure anywhere (every rank's sink aborted): the session ends without a
        commit (an engine that declares :data:`ROLLBACK` puts the committed weights back); within ``timeout_s``."""


@runtime_checkable
class GroupEngine(EngineAdapter, Protocol):
    """Joins and leaves the process group that bytes travel through (:data:`BROADCAST`, :data:`P2P`)."""

    def join_group(self, spec: GroupSpec) -> None:
        """The sink's ``connect`` (trainer rank 0 for a broadcast; the rank that forms the group of a
        per-rank sink), on a thread while the trainer forms its side of ``spec`` at the same time; kept
        across updates."""

    def leave_group(self, timeout_s: float | None = None) -> None:
        """The sink's ``disconnect`` (or ``abort``), while the trainer destroys its side at the same time
        (NCCL's teardown waits for its peers); within ``timeout_s``."""


@runtime_checkable
class BroadcastEngine(GroupEngine, Protocol):
    """:data:`BROADCAST`: receives each bucket's flat buffer by a broadcast over the joined group."""

    def receive_broadcast(self, bucket: Bucket, checksum: str | None) -> None:
        """Trainer rank 0, per bucket, on a thread while it broadcasts the bucket: the bucket being broadcast
        now (the engine receives it and loads it); not called where the metadata went ahead."""


@runtime_checkable
class P2PEngine(GroupEngine, Protocol):
    """:data:`P2P`: each engine TP rank receives its own per-rank bucket from trainer TP rank r."""

    def receive_p2p(self, index: int, ranks: Sequence[RankBucket]) -> None:
        """Trainer rank 0 of the replica that serves the engine, per bucket, while the trainer ranks send:
        what each engine rank receives of bucket ``index`` (one :class:`RankBucket` per engine rank); not
        called where the buckets went ahead."""


@runtime_checkable
class ReshardEngine(P2PEngine, Protocol):
    """:data:`RESHARD`: per-rank buckets into an engine of another layout; it declares how it holds each tensor."""

    def layout(self) -> EngineLayout:
        """Trainer rank 0, when the resharding sink connects (told to every rank): how the engine splits the
        HF tensors over its ranks."""


@runtime_checkable
class IPCEngine(EngineAdapter, Protocol):
    """:data:`IPC`: receives each bucket as CUDA IPC handles / shared-memory files of the colocated ranks."""

    def encode_ipc(self, bucket: Bucket) -> Any:
        """Every colocated trainer rank (rank r < the engine's TP size), per bucket, where no metadata went
        ahead: this rank's bucket as the engine's IPC payload, gathered on trainer rank 0."""

    def receive_ipc(self, index: int, payloads: Sequence[Any], checksums: Sequence[str | None] | None) -> None:
        """Trainer rank 0, per bucket, after :meth:`encode_ipc` on every colocated rank: every engine rank's
        payload (and checksum); every trainer rank holds its buffer until this returns."""


@runtime_checkable
class MemoryEngine(EngineAdapter, Protocol):
    """:data:`RELEASE_MEMORY`: frees weights / KV cache while the trainer runs, re-creates them after."""

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Trainer rank 0, after :meth:`pause`, between updates (``WeightSync.release_memory``): the memory of
        ``tags`` is freed."""

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Trainer rank 0: the weights re-created right after the next update's :meth:`begin_update` (before
        the sink writes into them), the rest after its commit."""


@runtime_checkable
class BroadcastAheadEngine(EngineAdapter, Protocol):
    """:data:`BROADCAST_AHEAD`: the metadata of every bucket in one request, then the broadcasts back to back."""

    def receive_broadcast_ahead(self, buckets: Sequence[Sequence[TensorMeta]], timeout_s: float,
                                delta: bool = False, digest: str | None = None) -> None:
        """Trainer rank 0, when the broadcast sink opens, on a thread: the metadata of every bucket of this
        update, in order, before the first is broadcast; returns once the engine loaded the last (within
        ``timeout_s``). ``delta`` (:data:`DELTA_AHEAD`): each bucket's delta header is broadcast right before
        its payload. ``digest``: the stream's digest of that metadata (equal digests, equal metadata), by which an
        engine that keeps what it was sent may be sent a key in its place."""


@runtime_checkable
class BroadcastPrepareEngine(EngineAdapter, Protocol):
    """:data:`BROADCAST_PREPARE`: a broadcast plan made ready before the first update."""

    def prepare_broadcast_ahead(self, buckets: Sequence[Sequence[TensorMeta]], digest: str, timeout_s: float) -> None:
        """Trainer rank 0, in ``WeightSync.prepare()`` (the broadcast sink's :meth:`prepare`), before the group is
        formed: every bucket's metadata, as :meth:`BroadcastAheadEngine.receive_broadcast_ahead` would send it, and
        the stream's ``digest`` of it; the engine makes its loads ready (within ``timeout_s``) and keeps the plan,
        whose key the first update then sends alone."""


@runtime_checkable
class P2PAheadEngine(EngineAdapter, Protocol):
    """:data:`P2P_AHEAD`: per bucket of an update, what each engine rank receives (one :class:`RankBucket` per rank),
    all in one request; then the buckets are sent back to back."""

    def receive_p2p_ahead(self, buckets: Sequence[Sequence[RankBucket]], timeout_s: float,
                          delta: bool = False) -> None:
        """Trainer rank 0 of the serving replica (the resharding sink: the first rank of its roster), when the
        sink opens, on a thread; returns once the engine loaded the last bucket (within ``timeout_s``).
        ``delta`` (:data:`DELTA_AHEAD`): each rank's bucket comes as its delta header, then its payload, from
        its ``src``."""


@dataclass(frozen=True, slots=True)
class IpcSession:
    """An update session a colocated update's request opens and commits itself (:data:`IPC_SESSION`), in place of
    the pause-and-begin and commit-and-resume requests around it: generation paused in ``pause`` mode and the
    session opened for ``version`` (rolled back if the trainer is silent past ``timeout_s``) before the buckets;
    committed, generation resumed, after them, where every trainer rank's last frame
    (:class:`~weightstream.wire.frames.Finish`) lets it."""

    pause: str
    version: str
    timeout_s: float


class PendingAnswer(Protocol[T_co]):
    """An engine's request sent, its answer not read yet (the HTTP adapters': ``PendingReply``)."""

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether the answer has come (or the connection ended), waiting at most ``wait_s``."""

    def result(self, timeout_s: float | None = None) -> T_co:
        """The answer, waiting at most ``timeout_s`` (default: the request's bound); or what the engine's refusal,
        or no answer, raises. Read once: later calls give the same."""

    def abandon(self) -> None:
        """The answer will not be read: the request's connection closes."""


@runtime_checkable
class IPCAheadEngine(EngineAdapter, Protocol):
    """:data:`IPC_AHEAD`: a colocated update's plan announced once, then one small frame per bucket on a
    control channel per TP rank (:mod:`weightstream.wire`)."""

    def receive_ipc_ahead(self, plan: str, num_buckets: int, channels: Sequence[str], client: str,
                          timeout_s: float, delta: bool = False,
                          session: IpcSession | None = None) -> PendingAnswer[str | None]:
        """Trainer rank 0, when the IPC sink opens: the request is sent, and returns unanswered (the trainer goes on
        to its channel; no thread waits); engine rank r connects to ``channels[r]`` (trainer rank r's), where the
        buckets' frames follow, and the engine answers once every bucket is loaded. ``delta``:
        every bucket comes as a delta payload (:class:`~weightstream.wire.frames.DeltaRecord`). ``session``
        (where the engine declares :data:`IPC_SESSION`): the request opens the session first and commits it
        after, and answers the version the engine then serves (None: not committed, as a trainer rank's last
        frame asked; the session stays open)."""

    def prepare_ipc_ahead(self, plan: str, num_buckets: int, channels: Sequence[str], client: str,
                          timeout_s: float) -> PendingAnswer[Any]:
        """Trainer rank 0, before the first update (the sink's ``prepare``) or, on the CPU per bucket, to
        announce the colocated ranks: as :meth:`receive_ipc_ahead` with no buckets; the engine keeps serving."""

    def release_ipc_buffers(self, client: str, timeout_s: float | None = None) -> None:
        """Trainer rank 0, when the IPC sink disconnects: the engine lets go of the buffers of ``client`` it
        keeps mapped."""

    def ipc_plan_frame(self, buckets: Sequence[Sequence[TensorMeta]]) -> Plan:
        """Each colocated trainer rank, once its engine rank connected and said it does not know the plan: the
        layout of every bucket, as the engine reads it on the control channel."""


@runtime_checkable
class CommitsAndResumes(EngineAdapter, Protocol):
    """:data:`COMMIT_AND_RESUME`: commits an update and resumes generation in one request."""

    def commit_and_resume(self) -> str | None:
        """Trainer rank 0, in place of :meth:`~EngineAdapter.commit_update` then
        :meth:`~EngineAdapter.resume`; returns the version the engine now reports."""


@runtime_checkable
class PreparesCommits(EngineAdapter, Protocol):
    """:data:`PREPARE_COMMIT`: the first phase of a commit; returns the version the commit will serve."""

    def prepare_commit(self) -> str | None:
        """Trainer rank 0, updating several engines, after every sink closed and before any engine commits:
        whatever the commit could fail on, the session kept restorable."""


@runtime_checkable
class PausesAndBegins(EngineAdapter, Protocol):
    """:data:`PAUSE_AND_BEGIN`: pauses generation and opens an update session in one request."""

    def pause_and_begin(self, mode: str, version: str | None, timeout_s: float | None = None) -> None:
        """Trainer rank 0, in place of :meth:`~EngineAdapter.pause` then :meth:`~EngineAdapter.begin_update`."""


@dataclass(frozen=True)
class DeltaChecks:
    """What a :data:`DELTA` engine applied in the open session: ``instance`` names the running engine (a
    restarted one names another), ``base`` what it held before (``instance/version`` of the last committed
    update whose buckets it keeps; None: none), ``buckets`` each bucket index's checksum of the bytes applied,
    per engine rank."""

    instance: str
    base: str | None
    buckets: dict[int, tuple[str, ...]]

    @classmethod
    def of_ranks(cls, ranks: Sequence[tuple[str, str | None, Mapping[int, str]]]) -> DeltaChecks:
        """The engine's checks from each of its ranks' (instance, committed version, bucket checksums), in rank
        order: its instance names every rank's (a restart of any changes it), its base is ``instance/version``
        where every rank keeps the same committed version, and each bucket's checksums are per rank ("" where a
        rank applied none of it)."""
        instance = "+".join(name for name, _, _ in ranks)
        versions = {version for _, version, _ in ranks}
        version = versions.pop() if len(versions) == 1 else None
        indices = sorted({i for _, _, held in ranks for i in held})
        return cls(instance, None if version is None else f"{instance}/{version}",
                   {i: tuple(held.get(i, "") for _, _, held in ranks) for i in indices})


@runtime_checkable
class DeltaEngine(EngineAdapter, Protocol):
    """:data:`DELTA` (or :data:`IPC_DELTA`, by IPC only): takes buckets whose buffer is a delta against the bytes it
    holds of them (a bucket's :attr:`~weightstream.streaming.bucket.Bucket.delta`), keeps the bytes it applied, and
    reports them."""

    def delta_base(self) -> str | None:
        """Trainer rank 0, before a delta-mode update's stream: ``instance/version`` of the committed update
        whose bytes the engine holds (None: it holds none)."""

    def delta_checks(self) -> DeltaChecks:
        """Trainer rank 0, after every rank's sink closed and before the commit: what the open session
        applied (:class:`DeltaChecks`)."""


# What an adapter implements for each capability its engine may declare.
CAPABILITY_PROTOCOLS: dict[str, type] = {
    BROADCAST: BroadcastEngine, P2P: P2PEngine, RESHARD: ReshardEngine, IPC: IPCEngine, RELEASE_MEMORY: MemoryEngine,
    BROADCAST_AHEAD: BroadcastAheadEngine, BROADCAST_PREPARE: BroadcastPrepareEngine, IPC_AHEAD: IPCAheadEngine,
    P2P_AHEAD: P2PAheadEngine,
    COMMIT_AND_RESUME: CommitsAndResumes, PAUSE_AND_BEGIN: PausesAndBegins, PREPARE_COMMIT: PreparesCommits,
    DELTA: DeltaEngine, IPC_DELTA: DeltaEngine,
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
