"""What one receive is, declared: the transport it comes by and how (:class:`ReceivePlan`: every bucket's metadata
first or one bucket per request, deltas or whole buckets), and the buckets it names, as an engine decodes them from
a request. One receive pipeline per transport takes a :class:`Receive`; "ahead" and "delta" are fields of its plan,
not twin entry points."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Transport", "ReceivePlan", "DenseBucket", "RankBucket", "Receive", "IpcReceive", "TensorReceive",
           "Request"]


class Transport(enum.Enum):
    BROADCAST = "broadcast"  # each bucket one broadcast of its flat buffer from group rank 0
    P2P = "p2p"  # each engine rank's bucket sent by one trainer rank
    PIECES = "pieces"  # resharded: each engine rank's bucket in parts from several trainer ranks
    IPC = "ipc"  # colocated: buffers lent over a control channel


@dataclass(frozen=True, slots=True)
class ReceivePlan:
    """How a receive goes: ``ahead``: every bucket of the update is named up front and received back to back with no
    request between (after a failure the rest are drained, and the failure raised at the end naming the bucket);
    ``delta``: an update in delta mode, each bucket a payload applied to the bytes held of it (sent ahead: each
    bucket's header on the wire before its payload; one bucket per request: its header in the request)."""

    transport: Transport
    ahead: bool = False
    delta: bool = False

    def __post_init__(self) -> None:
        if self.transport is Transport.IPC and not self.ahead:
            raise ValueError("an IPC receive names its buckets ahead (a plan of the trainer's)")


@dataclass(frozen=True, slots=True)
class DenseBucket:
    """A broadcast bucket: its tensors back to back in ``names`` order (``dtypes``, ``shapes``); the sender's
    ``checksum`` of its bytes and its ``delta`` header (``weightstream_delta``), where a request gives them."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    checksum: str | None = None
    delta: dict[str, Any] | None = None

    @property
    def key(self) -> tuple:
        """What its copy program is kept by."""
        return self.names, self.dtypes, self.shapes


@dataclass(frozen=True, slots=True)
class RankBucket:
    """One engine rank's bucket (or, resharded, one part of it) sent by trainer group rank ``src``: its tensors as
    the request names them (``metas``: name, dtype, shape, offset, shard), ``nbytes`` on the wire, the sender's
    ``checksum`` and ``delta`` header where given."""

    src: int
    metas: tuple[dict[str, Any], ...]
    nbytes: int
    checksum: str | None = None
    delta: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Receive:
    """One receive over a weight-update group (``group_name``): the buckets, each a :class:`DenseBucket`
    (broadcast), a :class:`RankBucket` (P2P) or a tuple of them (resharded pieces). ``load_format``: broadcast
    only, ``flattened_bucket`` (one buffer) or None (each tensor broadcast alone). ``prepare``: nothing is received;
    the buckets' copy programs, the receive buffers and the checks are made now, for the update that will bring them
    (ahead only)."""

    plan: ReceivePlan
    group_name: str
    buckets: tuple[Any, ...]
    load_format: str | None = "flattened_bucket"
    prepare: bool = False

    def __post_init__(self) -> None:
        problems = _receive_problems(self)
        if problems:
            raise ValueError("bad receive: " + "; ".join(problems))


_BUCKET_TYPES = {Transport.BROADCAST: DenseBucket, Transport.P2P: RankBucket, Transport.PIECES: tuple}


def _receive_problems(r: Receive) -> list[str]:
    kind = _BUCKET_TYPES.get(r.plan.transport)
    problems = [] if kind is not None else [f"{r.plan.transport.value} is not received over a group"]
    if kind is not None:
        problems += [f"bucket {i} is a {type(b).__name__}, not a {kind.__name__}" for i, b in enumerate(r.buckets)
                     if not isinstance(b, kind)]
    if r.plan.transport is Transport.PIECES:
        problems += [f"bucket {i}: its parts must be RankBuckets" for i, b in enumerate(r.buckets)
                     if isinstance(b, tuple) and not all(isinstance(p, RankBucket) for p in b)]
    if not r.plan.ahead and len(r.buckets) != 1:
        problems.append(f"{len(r.buckets)} buckets in a receive of one bucket per request")
    if r.prepare and (r.plan.transport is not Transport.BROADCAST or not r.plan.ahead or r.plan.delta):
        problems.append("only a broadcast sent ahead, of whole buckets, is prepared")
    return problems


@dataclass(frozen=True, slots=True)
class IpcReceive:
    """A colocated receive: the trainer's ``plan`` (its digest) of ``num_buckets`` buckets, over the control
    ``channel`` of trainer ``client``, each wait bounded by ``timeout_s``; ``delta``: in delta mode. ``prepare``:
    no update, only the plan learnt and the trainer's kept buffers mapped ahead of its first update. ``finish``: the
    trainer rank ends with a :class:`~weightstream.wire.frames.Finish` frame, whose ``commit`` the answer says.
    ``begin``: this rank opens its session first (the engine's request opened the engine's: ``ipc_session``);
    ``commit``: it commits it after, where the trainer lets it (an engine of one rank: its commit is the engine's),
    and the answer says ``committed``."""

    plan: str
    num_buckets: int
    channel: str
    client: str
    timeout_s: float
    delta: bool = False
    prepare: bool = False
    finish: bool = False
    begin: bool = False
    commit: bool = False

    @property
    def receive_plan(self) -> ReceivePlan:
        return ReceivePlan(Transport.IPC, ahead=True, delta=self.delta)


@dataclass(frozen=True, slots=True)
class TensorReceive:
    """SGLang's ``/update_weights_from_tensor``: one rank's ``payload`` (pickled, base64), its ``load_format`` and
    the sender's checksum of a flattened bucket."""

    payload: str
    load_format: str | None = None
    expected_checksum: str | None = None


Request = Receive | IpcReceive | TensorReceive
