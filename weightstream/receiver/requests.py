"""The requests an engine's HTTP face decodes: a weight-update group's start and end, an update session's phases,
the weight version, checksums of the weights held, and the updates themselves. Each is a frozen record with one
``decode`` of a parsed JSON body, which lists every problem of the body in one :class:`RequestError`; fields a body
adds beyond its schema are ignored (SGLang's clients send fields of newer versions, and SGLang's bodies carry no
version of their own). An update's request (:class:`UpdateRequest`: :class:`BroadcastUpdate`,
:class:`TensorUpdate`, :class:`IpcUpdate`, :class:`P2pUpdate`) is checked by its route's schema and its buckets'
checks (:data:`UPDATE_SCHEMAS`, :func:`update_problems`) as it is decoded, and gives each engine rank's receive of
:mod:`weightstream.receiver.plan` (:meth:`UpdateRequest.receives`), checked against the engine's TP.

A schema is ``field -> (accepted types, required)``; once a field has its type, its bounds are checked: durations
(finite seconds, so that every wait ends), a few integers, and short texts (a version is echoed in replies)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from weightstream.receiver.ahead_plans import KeyedReceive
from weightstream.receiver.plan import (
    DenseBucket,
    IpcReceive,
    RankBucket,
    Receive,
    ReceivePlan,
    Request,
    TensorReceive,
    Transport,
)
from weightstream.receiver.schema import (
    bucket_problems,
    buckets_problems,
    delta_problems,
    duration_problem,
    int_lists,
    range_problem,
    text_problem,
)
from weightstream.wire.channel import address_problem

__all__ = [
    "Schema", "NUMBER", "OPT_STR", "DURATION_FIELDS", "INT_RANGES", "TEXT_FIELDS", "RequestError", "field_problems",
    "refuse", "DEFAULT_GROUP", "EmptyRequest", "InitGroupRequest", "DestroyGroupRequest", "BeginRequest",
    "CommitRequest", "PauseRequest", "VersionRequest", "WeightChecksumsRequest", "ReleaseIpcRequest",
    "BROADCAST_ROUTE", "BROADCAST_AHEAD_ROUTE", "TENSOR_ROUTE", "IPC_AHEAD_ROUTE", "PREPARE_IPC_ROUTE", "P2P_ROUTE",
    "P2P_AHEAD_ROUTE", "PREPARE_BROADCAST_ROUTE", "UPDATE_SCHEMAS", "update_problems", "RankReceives",
    "UpdateRequest", "BroadcastUpdate", "TensorUpdate", "IpcUpdate", "P2pUpdate", "UPDATES", "decode_update",
]

Schema = Mapping[str, tuple[tuple[type, ...], bool]]
NUMBER: tuple[type, ...] = (int, float)
OPT_STR: tuple[type, ...] = (str, type(None))

DURATION_FIELDS = frozenset({"timeout_s"})
INT_RANGES = {"master_port": (1, 65535), "world_size": (1, 1 << 16), "rank_offset": (0, 1 << 16),
              "num_buckets": (0, 1 << 24)}
TEXT_FIELDS = frozenset({"weight_version", "new_version", "group_name", "client", "plan", "weightstream_plan",
                         "backend", "load_format", "pause", "mode", "master_address"})

DEFAULT_GROUP = "weight_update_group"


class RequestError(ValueError):
    """A body its route refuses as it stands (HTTP 400): ``message`` names every problem."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(message)


def _bound_problem(name: str, value: Any) -> str | None:
    if name in DURATION_FIELDS:
        return duration_problem(name, value)
    if name in INT_RANGES:
        return range_problem(name, value, *INT_RANGES[name])
    if name in TEXT_FIELDS:
        return text_problem(name, value)
    return None


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def field_problems(schema: Schema, body: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``body`` under ``schema``: fields missing, of a type not taken, or out of bounds."""
    problems = []
    for name, (types, required) in schema.items():
        if name not in body:
            if required:
                problems.append(f"missing field {name!r}")
            continue
        value = body[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            problems.append(f"field {name!r} must be {_type_names(types)}, got {type(value).__name__}")
        elif (problem := _bound_problem(name, value)) is not None:
            problems.append(problem)
    return problems


def refuse(route: str, problems: list[str]) -> None:
    """Raise one :class:`RequestError` for ``route`` listing ``problems`` (none: return)."""
    if problems:
        raise RequestError(f"bad request to {route}: " + "; ".join(problems))


def _checked(route: str, schema: Schema, body: Mapping[str, Any]) -> Mapping[str, Any]:
    refuse(route, field_problems(schema, body))
    return body


@dataclass(frozen=True, slots=True)
class EmptyRequest:
    """A route that reads no field of its body (a GET's, or a POST that only names an action)."""

    FIELDS: ClassVar[Schema] = {}

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> EmptyRequest:
        return cls()


@dataclass(frozen=True, slots=True)
class InitGroupRequest:
    """``/init_weights_update_group``: join the trainer's group at ``master_address:master_port`` as ranks
    ``rank_offset``.. of ``world_size``; ``timeout_s`` bounds the workers' wait. ``warm``/``warm_senders``: the
    group's transfers set up ahead (weightstream's fields)."""

    ROUTE: ClassVar[str] = "/init_weights_update_group"
    FIELDS: ClassVar[Schema] = {
        "master_address": ((str,), True), "master_port": ((int,), True), "rank_offset": ((int,), True),
        "world_size": ((int,), True), "group_name": ((str,), False), "backend": ((str,), False),
        "timeout_s": (NUMBER, False), "weightstream_warm": ((str,), False),
        "weightstream_warm_senders": ((int,), False),
    }

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"
    timeout_s: float = 60.0
    warm: str = ""
    warm_senders: int = 1

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> InitGroupRequest:
        b = _checked(cls.ROUTE, cls.FIELDS, body)
        return cls(b["master_address"], int(b["master_port"]), int(b["rank_offset"]), int(b["world_size"]),
                   b.get("group_name", DEFAULT_GROUP), b.get("backend", "nccl"), float(b.get("timeout_s") or 60.0),
                   b.get("weightstream_warm", ""), int(b.get("weightstream_warm_senders", 1)))


@dataclass(frozen=True, slots=True)
class DestroyGroupRequest:
    """``/destroy_weights_update_group``: leave the group ``group_name``."""

    ROUTE: ClassVar[str] = "/destroy_weights_update_group"
    FIELDS: ClassVar[Schema] = {"group_name": ((str,), False)}

    group_name: str = DEFAULT_GROUP

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> DestroyGroupRequest:
        return cls(_checked(cls.ROUTE, cls.FIELDS, body).get("group_name", DEFAULT_GROUP))


@dataclass(frozen=True, slots=True)
class BeginRequest:
    """``/begin_weight_update``: open a session, rolled back if the trainer is silent past ``timeout_s`` (None:
    the engine's bound); ``pause``: a mode to pause generation in first (empty: generation goes on);
    ``weight_version``: what the commit will serve, unless a bucket says otherwise."""

    ROUTE: ClassVar[str] = "/begin_weight_update"
    FIELDS: ClassVar[Schema] = {"timeout_s": (NUMBER + (type(None),), False), "pause": ((str,), False),
                                "weight_version": (OPT_STR, False)}

    timeout_s: float | None = None
    pause: str = ""
    weight_version: str | None = None

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> BeginRequest:
        b = _checked(cls.ROUTE, cls.FIELDS, body)
        version = b.get("weight_version")
        return cls(b.get("timeout_s"), b.get("pause") or "", None if version is None else str(version))


@dataclass(frozen=True, slots=True)
class CommitRequest:
    """``/end_weight_update``: commit the session; ``resume``: generation continues once it is committed."""

    ROUTE: ClassVar[str] = "/end_weight_update"
    FIELDS: ClassVar[Schema] = {"resume": ((bool,), False)}

    resume: bool = False

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> CommitRequest:
        return cls(_checked(cls.ROUTE, cls.FIELDS, body).get("resume", False))


@dataclass(frozen=True, slots=True)
class PauseRequest:
    """``/pause_generation``: ``mode`` as SGLang names it (the engine pauses between decode steps in every
    mode)."""

    ROUTE: ClassVar[str] = "/pause_generation"
    FIELDS: ClassVar[Schema] = {"mode": ((str,), False)}

    mode: str | None = None

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> PauseRequest:
        return cls(_checked(cls.ROUTE, cls.FIELDS, body).get("mode"))


@dataclass(frozen=True, slots=True)
class VersionRequest:
    """``/update_weight_version``: the version the engine serves from now on."""

    ROUTE: ClassVar[str] = "/update_weight_version"
    FIELDS: ClassVar[Schema] = {"new_version": ((str,), True)}

    new_version: str

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> VersionRequest:
        return cls(str(_checked(cls.ROUTE, cls.FIELDS, body)["new_version"]))


@dataclass(frozen=True, slots=True)
class WeightChecksumsRequest:
    """``/weightstream/weight_checksums``: the tensors whose held bytes are checksummed, by name."""

    ROUTE: ClassVar[str] = "/weightstream/weight_checksums"
    FIELDS: ClassVar[Schema] = {"names": ((list,), True)}

    names: tuple[str, ...]

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> WeightChecksumsRequest:
        names = _checked(cls.ROUTE, cls.FIELDS, body)["names"]
        refuse(cls.ROUTE, [] if all(isinstance(n, str) for n in names) else ["names must be a list of tensor names"])
        return cls(tuple(names))


@dataclass(frozen=True, slots=True)
class ReleaseIpcRequest:
    """``/weightstream/release_ipc_buffers``: close the IPC buffers mapped of trainer ``client``."""

    ROUTE: ClassVar[str] = "/weightstream/release_ipc_buffers"
    FIELDS: ClassVar[Schema] = {"client": ((str,), True)}

    client: str

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> ReleaseIpcRequest:
        return cls(_checked(cls.ROUTE, cls.FIELDS, body)["client"])


# -- the updates: each route's body decoded once into the receives of :mod:`weightstream.receiver.plan` ---------

BROADCAST_ROUTE = "/update_weights_from_distributed"
BROADCAST_AHEAD_ROUTE = "/weightstream/update_weights_from_distributed_ahead"
TENSOR_ROUTE = "/update_weights_from_tensor"
IPC_AHEAD_ROUTE = "/weightstream/update_weights_from_ipc_ahead"
PREPARE_IPC_ROUTE = "/weightstream/prepare_ipc_ahead"
P2P_ROUTE = "/weightstream/update_weights_from_p2p"
P2P_AHEAD_ROUTE = "/weightstream/update_weights_from_p2p_ahead"
PREPARE_BROADCAST_ROUTE = "/weightstream/prepare_broadcast_ahead"  # a broadcast plan ahead, outside any update

# The body each update route takes.
UPDATE_SCHEMAS: dict[str, Schema] = {
    BROADCAST_ROUTE: {
        "names": ((list,), True), "dtypes": ((list,), True), "shapes": ((list,), True), "group_name": ((str,), False),
        "load_format": (OPT_STR, False), "weight_version": (OPT_STR, False), "flush_cache": ((bool,), False),
        "weightstream_checksum": (OPT_STR, False), "weightstream_delta": ((dict, type(None)), False),
    },
    BROADCAST_AHEAD_ROUTE: {  # the buckets, or the key of a plan the engine keeps (one of the two)
        "buckets": ((list,), False), "weightstream_plan": ((str,), False), "group_name": ((str,), False),
        "load_format": (OPT_STR, False), "weight_version": (OPT_STR, False),
        "weightstream_delta_mode": ((bool,), False),
    },
    IPC_AHEAD_ROUTE: {  # (``weightstream_begin``/``_commit``: the session opened and committed around it, ipc_session)
        "plan": ((str,), True), "num_buckets": ((int,), True), "channels": ((list,), True),
        "client": ((str,), True), "timeout_s": (NUMBER, False), "weight_version": (OPT_STR, False),
        "weightstream_delta_mode": ((bool,), False), "weightstream_begin": ((dict,), False),
        "weightstream_commit": ((dict,), False),
    },
    TENSOR_ROUTE: {
        "serialized_named_tensors": ((list, str), True), "load_format": (OPT_STR, False),
        "weight_version": (OPT_STR, False), "flush_cache": ((bool,), False),
        "weightstream_checksums": ((list, type(None)), False),
    },
    P2P_ROUTE: {
        "ranks": ((list,), True), "group_name": ((str,), False), "weight_version": (OPT_STR, False),
    },
    P2P_AHEAD_ROUTE: {
        "buckets": ((list,), True), "group_name": ((str,), False), "weight_version": (OPT_STR, False),
        "weightstream_delta_mode": ((bool,), False),
    },
}
UPDATE_SCHEMAS[PREPARE_BROADCAST_ROUTE] = {
    "buckets": ((list,), True), "group_name": ((str,), False), "load_format": (OPT_STR, False),
}
# Preparing a colocated update takes the update's fields, less the weight version (no update is open).
UPDATE_SCHEMAS[PREPARE_IPC_ROUTE] = {k: v for k, v in UPDATE_SCHEMAS[IPC_AHEAD_ROUTE].items()
                                     if k not in ("weight_version", "weightstream_delta_mode", "weightstream_begin",
                                                  "weightstream_commit")}


def _channels_problems(body: Mapping[str, Any]) -> list[str]:
    if not any(address_problem(c) for c in body["channels"]):
        return []
    return ["channels must be 'unix:@NAME' addresses (the trainer ranks' control channels), one per engine rank"]


def _ipc_problems(body: Mapping[str, Any]) -> list[str]:
    """A colocated update's channels, and the session it opens and commits where it asks (the fields of
    ``/begin_weight_update`` and ``/end_weight_update``)."""
    nested = [f"{field}: {p}" for field, schema in (("weightstream_begin", BeginRequest.FIELDS),
                                                    ("weightstream_commit", CommitRequest.FIELDS))
              if field in body for p in field_problems(schema, body[field])]
    if "weightstream_commit" in body and "weightstream_begin" not in body:
        nested.append("weightstream_commit needs weightstream_begin (the request commits only a session it opened)")
    return _channels_problems(body) + nested


def _tensor_problems(body: Mapping[str, Any]) -> list[str]:
    payloads = body["serialized_named_tensors"]
    problems = [] if isinstance(payloads, str) or all(isinstance(p, str) for p in payloads) else [
        "serialized_named_tensors must be one payload (text) or a list of them, one per engine rank"]
    checksums = body.get("weightstream_checksums") or []
    if not all(isinstance(c, str | None) for c in checksums):
        problems.append("weightstream_checksums must be a list of checksums (text or null), one per engine rank")
    return problems


def _entry_problems(k: int, e: Any) -> list[str]:
    """What is wrong with entry ``k`` of a per-rank bucket: it gives ``src`` (int), ``metas`` (list) and ``nbytes``
    (int); ``rank`` (the engine rank a resharded part is for), ``checksum`` and ``delta`` where it gives them."""
    if not (isinstance(e, dict) and isinstance(e.get("src"), int) and isinstance(e.get("metas"), list)
            and isinstance(e.get("nbytes"), int)):
        return [f"entry {k}: needs 'src' (int), 'metas' (list) and 'nbytes' (int)"]
    problems = [] if int_lists(e.get("rank", 0), 0) else [
        f"entry {k}: 'rank' must be a non-negative integer (an engine rank)"]
    if not isinstance(e.get("checksum"), str | None):
        problems.append(f"entry {k}: 'checksum' must be text or null")
    return problems + [f"entry {k}: {p}" for p in delta_problems(e.get("delta"))]


def _plain_entry(e: Any) -> bool:
    """An entry :func:`_entry_problems` finds nothing wrong with, told at a glance (a plan's entries are checked one
    by one only where this is not so)."""
    return (type(e) is dict and type(e.get("src")) is int and type(e.get("metas")) is list
            and type(e.get("nbytes")) is int and e.get("delta") is None
            and ((c := e.get("checksum")) is None or type(c) is str) and type(rank := e.get("rank", 0)) is int
            and rank >= 0)


def _p2p_problems(buckets: list) -> list[str]:
    """Every problem of per-rank buckets' entries, in one: each bucket a list of entries (:func:`_entry_problems`)."""
    problems = [f"bucket {i}: {p}" for i, x in enumerate(buckets)
                for p in ([p for k, e in enumerate(x) if not _plain_entry(e) for p in _entry_problems(k, e)]
                          if isinstance(x, list) else ["not a list of entries"])]
    return ["bad P2P buckets: " + "; ".join(problems[:8])] if problems else []


def _ahead_problems(body: Mapping[str, Any]) -> list[str]:
    """A broadcast sent ahead names its buckets, or the key of a plan the engine keeps
    (:mod:`~weightstream.receiver.ahead_plans`): one of the two."""
    if ("buckets" in body) == ("weightstream_plan" in body):
        return ["give buckets or weightstream_plan (the key of a plan this engine keeps), one of the two"]
    return buckets_problems(body["buckets"]) if "buckets" in body else []


_UPDATE_CHECKS: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    BROADCAST_ROUTE: lambda b: bucket_problems(b) + delta_problems(b.get("weightstream_delta")),
    BROADCAST_AHEAD_ROUTE: _ahead_problems,
    PREPARE_BROADCAST_ROUTE: lambda b: buckets_problems(b["buckets"]),
    TENSOR_ROUTE: _tensor_problems,
    IPC_AHEAD_ROUTE: _ipc_problems,
    PREPARE_IPC_ROUTE: _channels_problems,
    P2P_ROUTE: lambda b: _p2p_problems([b["ranks"]]),
    P2P_AHEAD_ROUTE: lambda b: _p2p_problems(b["buckets"]),
}


def update_problems(path: str, body: Mapping[str, Any]) -> list[str]:
    """Every problem of an update route's ``body`` for ``path``: its schema's, then (once the fields have their
    types) its buckets' metadata, delta headers, payloads and control channels."""
    problems = field_problems(UPDATE_SCHEMAS.get(path, {}), body)
    check = _UPDATE_CHECKS.get(path)
    return problems if problems or check is None else check(body)


def _checked_update(route: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
    refuse(route, update_problems(route, body))
    return body


@dataclass(frozen=True, slots=True)
class RankReceives:
    """What an update asks of an engine's ranks: each rank's receive, in rank order, and how long the engine waits
    for their answers (None: its bound on any command)."""

    per_rank: tuple[Request, ...]
    wait_s: float | None = None


class UpdateRequest(Protocol):
    """An update route's request, decoded from its body by :func:`decode_update`: the route it came by, the version
    a commit serves after it (None: unchanged), whether it carries deltas (the engine then keeps the bytes it
    applies them to), and each rank's receive (:meth:`receives`)."""

    @property
    def route(self) -> str: ...

    @property
    def weight_version(self) -> str | None: ...

    @property
    def delta(self) -> bool: ...

    def receives(self, tp: int, timeout_s: float) -> RankReceives:
        """Each of ``tp`` engine ranks' receive, each wait on the trainer bounded by the request's ``timeout_s``
        where it gives one, else by ``timeout_s`` (the session's); one :class:`RequestError` listing everything
        of the request that does not fit an engine of ``tp`` ranks."""
        ...


@dataclass(frozen=True, slots=True)
class BroadcastUpdate:
    """``/update_weights_from_distributed``: one bucket over group ``group_name``, its tensors broadcast one by one
    (``load_format`` None) or as one buffer (``flattened_bucket``; a delta's header in the bucket); ``ahead``
    (``/weightstream/update_weights_from_distributed_ahead``): every bucket's metadata, then the buckets back to
    back, deltas where ``delta_mode``."""

    ROUTES: ClassVar[tuple[str, ...]] = (BROADCAST_ROUTE, BROADCAST_AHEAD_ROUTE)

    buckets: tuple[DenseBucket, ...]
    ahead: bool = False
    group_name: str = DEFAULT_GROUP
    load_format: str | None = None
    weight_version: str | None = None
    delta_mode: bool = False
    plan_key: str | None = None  # sent ahead by the key of a plan the engine keeps: ``buckets`` are then its
    prepare: bool = False  # ``/weightstream/prepare_broadcast_ahead``: the plan made ready, nothing received

    @property
    def route(self) -> str:
        return PREPARE_BROADCAST_ROUTE if self.prepare else self.ROUTES[self.ahead]

    @property
    def delta(self) -> bool:
        return self.delta_mode or any(b.delta is not None for b in self.buckets)

    @classmethod
    def decode(cls, route: str, body: Mapping[str, Any]) -> BroadcastUpdate:
        b = _checked_update(route, body)
        ahead = route in (BROADCAST_AHEAD_ROUTE, PREPARE_BROADCAST_ROUTE)
        buckets = [_dense_bucket(x) for x in b.get("buckets", ())] if ahead else [
            _dense_bucket(b, b.get("weightstream_checksum"), b.get("weightstream_delta"))]
        return cls(tuple(buckets), ahead, b.get("group_name", DEFAULT_GROUP), b.get("load_format"),
                   b.get("weight_version"), b.get("weightstream_delta_mode") is True,
                   b.get("weightstream_plan") if ahead else None, route == PREPARE_BROADCAST_ROUTE)

    def receives(self, tp: int, timeout_s: float) -> RankReceives:
        return RankReceives((self._receive(self.buckets),) * tp)

    def keyed_receives(self, key: str, held: Sequence[Collection[str]]) -> tuple[KeyedReceive, ...]:
        """Each rank's receive of this broadcast sent ahead (or prepared), whose plan the engine keeps by ``key``: the
        key alone to a rank whose last answer named it among the plans it holds (``held``, by rank), the buckets
        with the key to any other (:class:`~weightstream.receiver.ahead_plans.KeyedReceive`)."""
        bare, whole = self._receive(()), self._receive(self.buckets)
        return tuple(KeyedReceive(key, bare, True) if key in h else KeyedReceive(key, whole) for h in held)

    def _receive(self, buckets: tuple[DenseBucket, ...]) -> Receive:
        plan = ReceivePlan(Transport.BROADCAST, self.ahead, self.delta)
        return Receive(plan, self.group_name, buckets, self.load_format, self.prepare)


def _dense_bucket(x: Mapping[str, Any], checksum: str | None = None, delta: dict | None = None) -> DenseBucket:
    """A broadcast bucket as a body names it (``names``, ``dtypes``, ``shapes``: checked before)."""
    return DenseBucket(tuple(x["names"]), tuple(x["dtypes"]), tuple(tuple(s) for s in x["shapes"]), checksum, delta)


@dataclass(frozen=True, slots=True)
class TensorUpdate:
    """``/update_weights_from_tensor`` (SGLang's): each engine rank's ``payloads`` entry (pickled, base64), their
    ``load_format`` and, for a flattened bucket, the sender's ``checksums`` of each rank's bytes."""

    ROUTES: ClassVar[tuple[str, ...]] = (TENSOR_ROUTE,)

    payloads: tuple[str, ...]
    load_format: str | None = None
    checksums: tuple[str | None, ...] = ()
    weight_version: str | None = None

    @property
    def route(self) -> str:
        return TENSOR_ROUTE

    @property
    def delta(self) -> bool:
        return False

    @classmethod
    def decode(cls, route: str, body: Mapping[str, Any]) -> TensorUpdate:
        b = _checked_update(route, body)
        payloads = b["serialized_named_tensors"]
        return cls(tuple([payloads] if isinstance(payloads, str) else payloads), b.get("load_format"),
                   tuple(b.get("weightstream_checksums") or ()), b.get("weight_version"))

    def receives(self, tp: int, timeout_s: float) -> RankReceives:
        checksums = self.checksums or (None,) * len(self.payloads)
        refuse(self.route, [f"got {n} {what} for {tp} engine TP ranks" for n, what in (
            (len(self.payloads), "payloads"), (len(self.checksums) or tp, "checksums")) if n != tp])
        return RankReceives(tuple(TensorReceive(p, self.load_format, c) for p, c in zip(self.payloads, checksums,
                                                                                          strict=True)))


@dataclass(frozen=True, slots=True)
class IpcUpdate:
    """``/weightstream/update_weights_from_ipc_ahead``: a colocated update by the trainer's ``plan`` (its digest) of
    ``num_buckets`` buckets, each engine rank over its control channel (``channels``, in rank order) of trainer
    ``client``, each wait bounded by ``timeout_s`` (None: the session's); deltas where ``delta``. ``prepare``
    (``/weightstream/prepare_ipc_ahead``): no update, only the plan learnt and the trainer's kept buffers mapped.
    ``begin`` (``ipc_session``): the request opens the session first, as ``/begin_weight_update`` with these fields
    would (each rank its own with its receive); ``commit``: it commits the session after the buckets, as
    ``/end_weight_update`` would, where every engine rank's trainer rank let it in its last frame
    (:class:`~weightstream.wire.frames.Finish`) (an engine of one rank commits with its receive)."""

    ROUTES: ClassVar[tuple[str, ...]] = (IPC_AHEAD_ROUTE, PREPARE_IPC_ROUTE)

    plan: str
    num_buckets: int
    channels: tuple[str, ...]
    client: str
    timeout_s: float | None = None
    weight_version: str | None = None
    delta: bool = False
    prepare: bool = False
    begin: BeginRequest | None = None
    commit: CommitRequest | None = None

    @property
    def route(self) -> str:
        return self.ROUTES[self.prepare]

    @classmethod
    def decode(cls, route: str, body: Mapping[str, Any]) -> IpcUpdate:
        b = _checked_update(route, body)
        timeout_s, prepare = b.get("timeout_s"), route == PREPARE_IPC_ROUTE
        begin, commit = b.get("weightstream_begin"), b.get("weightstream_commit")
        return cls(b["plan"], b["num_buckets"], tuple(b["channels"]), b["client"],
                   None if timeout_s is None else float(timeout_s), None if prepare else b.get("weight_version"),
                   not prepare and b.get("weightstream_delta_mode") is True, prepare,
                   None if begin is None else BeginRequest.decode(begin),
                   None if commit is None else CommitRequest.decode(commit))

    def receives(self, tp: int, timeout_s: float) -> RankReceives:
        """The engine waits for the ranks' answers a bound per bucket and three more (they answer once the last
        bucket is loaded); four, for a prepare."""
        refuse(self.route, [] if len(self.channels) == tp else [
            f"got {len(self.channels)} control channels for {tp} engine TP ranks"])
        bound = self.timeout_s or timeout_s
        folded = self.commit is not None
        return RankReceives(tuple(IpcReceive(self.plan, self.num_buckets, c, self.client, bound, self.delta,
                                             self.prepare, folded, self.begin is not None, folded and tp == 1)
                                  for c in self.channels),
                            bound * (4 if self.prepare else self.num_buckets + 3))


@dataclass(frozen=True, slots=True)
class P2pUpdate:
    """``/weightstream/update_weights_from_p2p``: one bucket (``buckets`` holds one), each engine rank's part sent
    by send/recv from one trainer rank (the bucket's entries in engine rank order), or, resharded, in parts from
    several: ``ranks`` then names the engine rank each entry is for (an engine rank may hear several trainer ranks,
    or none; None where an entry names none). ``ahead`` (``/weightstream/update_weights_from_p2p_ahead``): every
    bucket's entries, then the buckets back to back, deltas where ``delta_mode``."""

    ROUTES: ClassVar[tuple[str, ...]] = (P2P_ROUTE, P2P_AHEAD_ROUTE)

    buckets: tuple[tuple[RankBucket, ...], ...]
    ranks: tuple[tuple[int | None, ...], ...] | None = None
    ahead: bool = False
    group_name: str = DEFAULT_GROUP
    weight_version: str | None = None
    delta_mode: bool = False

    @property
    def route(self) -> str:
        return self.ROUTES[self.ahead]

    @property
    def delta(self) -> bool:
        """Ahead, the mode; one bucket per request, whether an entry gives a delta header."""
        return self.delta_mode if self.ahead else any(e.delta is not None for x in self.buckets for e in x)

    @classmethod
    def decode(cls, route: str, body: Mapping[str, Any]) -> P2pUpdate:
        b = _checked_update(route, body)
        ahead = route == P2P_AHEAD_ROUTE
        entries = b["buckets"] if ahead else [b["ranks"]]
        buckets = tuple(tuple(RankBucket(e["src"], tuple(e["metas"]), e["nbytes"], e.get("checksum"), e.get("delta"))
                              for e in x) for x in entries)
        ranks = tuple(tuple(e.get("rank") for e in x) for x in entries) if any(
            "rank" in e for x in entries for e in x) else None
        return cls(buckets, ranks, ahead, b.get("group_name", DEFAULT_GROUP), b.get("weight_version"),
                   b.get("weightstream_delta_mode") is True)

    def receives(self, tp: int, timeout_s: float) -> RankReceives:
        return RankReceives(self._whole(tp) if self.ranks is None else self._pieces(self.ranks, tp))

    def _whole(self, tp: int) -> tuple[Receive, ...]:
        """Each bucket one entry per engine rank, in rank order."""
        problems = [f"bucket {i}: {len(x)} entries, the engine has {tp} ranks" for i, x in enumerate(self.buckets)
                    if len(x) != tp]
        refuse(self.route, ["bad P2P buckets: " + "; ".join(problems[:8])] if problems else [])
        return tuple(Receive(ReceivePlan(Transport.P2P, self.ahead, self.delta_mode if self.ahead else
                                         self.buckets[0][r].delta is not None),
                             self.group_name, tuple(x[r] for x in self.buckets)) for r in range(tp))

    def _pieces(self, ranks: tuple[tuple[int | None, ...], ...], tp: int) -> tuple[Receive, ...]:
        """Each bucket's parts gathered by the engine rank they name."""
        refuse(self.route, [f"bucket {i}: a part for engine rank {r!r}; the engine has ranks 0..{tp - 1}"
                            for i, x in enumerate(ranks) for r in x if r is None or r >= tp][:8])
        parts: list[list[list[RankBucket]]] = [[[] for _ in self.buckets] for _ in range(tp)]
        for i, (x, named) in enumerate(zip(self.buckets, ranks, strict=True)):
            for entry, r in zip(x, named, strict=True):
                if r is not None:  # (refused above)
                    parts[r][i].append(entry)
        plan = ReceivePlan(Transport.PIECES, self.ahead, self.delta)
        return tuple(Receive(plan, self.group_name, tuple(map(tuple, mine))) for mine in parts)


UPDATES: dict[str, Callable[[str, Mapping[str, Any]], UpdateRequest]] = {
    BROADCAST_ROUTE: BroadcastUpdate.decode, BROADCAST_AHEAD_ROUTE: BroadcastUpdate.decode,
    PREPARE_BROADCAST_ROUTE: BroadcastUpdate.decode,
    TENSOR_ROUTE: TensorUpdate.decode, IPC_AHEAD_ROUTE: IpcUpdate.decode, PREPARE_IPC_ROUTE: IpcUpdate.decode,
    P2P_ROUTE: P2pUpdate.decode, P2P_AHEAD_ROUTE: P2pUpdate.decode,
}


def decode_update(route: str, body: Mapping[str, Any]) -> UpdateRequest:
    """Update route ``route``'s ``body`` as its typed request (:data:`UPDATES`); one :class:`RequestError` listing
    every problem of a body refused (:func:`update_problems`)."""
    return UPDATES[route](route, body)
