"""The requests an engine's HTTP face decodes besides the updates themselves (:mod:`weightstream.receiver.plan`):
a weight-update group's start and end, an update session's phases, the weight version, and checksums of the
weights held. Each is a frozen record with one ``decode`` of a parsed JSON body, which lists every problem of the
body in one :class:`RequestError`; fields a body adds beyond its schema are ignored (SGLang's clients send fields
of newer versions). The update routes' bodies are checked here too (:data:`UPDATE_SCHEMAS`, :func:`update_problems`)
before an engine decodes them into its receives.

A schema is ``field -> (accepted types, required)``; once a field has its type, its bounds are checked: durations
(finite seconds, so that every wait ends), a few integers, and short texts (a version is echoed in replies)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from weightstream.receiver.schema import (
    bucket_problems,
    buckets_problems,
    delta_problems,
    duration_problem,
    range_problem,
    text_problem,
)
from weightstream.wire.channel import address_problem

__all__ = [
    "Schema", "NUMBER", "OPT_STR", "DURATION_FIELDS", "INT_RANGES", "TEXT_FIELDS", "RequestError", "field_problems",
    "refuse", "DEFAULT_GROUP", "EmptyRequest", "InitGroupRequest", "DestroyGroupRequest", "BeginRequest",
    "CommitRequest", "PauseRequest", "VersionRequest", "WeightChecksumsRequest", "ReleaseIpcRequest",
    "UPDATE_SCHEMAS", "update_problems",
]

Schema = Mapping[str, tuple[tuple[type, ...], bool]]
NUMBER: tuple[type, ...] = (int, float)
OPT_STR: tuple[type, ...] = (str, type(None))

DURATION_FIELDS = frozenset({"timeout_s"})
INT_RANGES = {"master_port": (1, 65535), "world_size": (1, 1 << 16), "rank_offset": (0, 1 << 16),
              "num_buckets": (0, 1 << 24)}
TEXT_FIELDS = frozenset({"weight_version", "new_version", "group_name", "client", "plan", "backend",
                         "load_format", "pause", "mode", "master_address"})

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


# The body each update route takes (an engine decodes it into the receives of :mod:`weightstream.receiver.plan`).
UPDATE_SCHEMAS: dict[str, Schema] = {
    "/update_weights_from_distributed": {
        "names": ((list,), True), "dtypes": ((list,), True), "shapes": ((list,), True), "group_name": ((str,), False),
        "load_format": (OPT_STR, False), "weight_version": (OPT_STR, False), "flush_cache": ((bool,), False),
        "weightstream_checksum": (OPT_STR, False), "weightstream_delta": ((dict, type(None)), False),
    },
    "/weightstream/update_weights_from_distributed_ahead": {
        "buckets": ((list,), True), "group_name": ((str,), False), "load_format": (OPT_STR, False),
        "weight_version": (OPT_STR, False), "weightstream_delta_mode": ((bool,), False),
    },
    "/weightstream/update_weights_from_ipc_ahead": {
        "plan": ((str,), True), "num_buckets": ((int,), True), "channels": ((list,), True),
        "client": ((str,), True), "timeout_s": (NUMBER, False), "weight_version": (OPT_STR, False),
        "weightstream_delta_mode": ((bool,), False),
    },
    "/update_weights_from_tensor": {
        "serialized_named_tensors": ((list, str), True), "load_format": (OPT_STR, False),
        "weight_version": (OPT_STR, False), "flush_cache": ((bool,), False),
        "weightstream_checksums": ((list, type(None)), False),
    },
    "/weightstream/update_weights_from_p2p": {
        "ranks": ((list,), True), "group_name": ((str,), False), "weight_version": (OPT_STR, False),
    },
    "/weightstream/update_weights_from_p2p_ahead": {
        "buckets": ((list,), True), "group_name": ((str,), False), "weight_version": (OPT_STR, False),
        "weightstream_delta_mode": ((bool,), False),
    },
}
# Preparing a colocated update takes the update's fields, less the weight version (no update is open).
UPDATE_SCHEMAS["/weightstream/prepare_ipc_ahead"] = {
    k: v for k, v in UPDATE_SCHEMAS["/weightstream/update_weights_from_ipc_ahead"].items()
    if k not in ("weight_version", "weightstream_delta_mode")}


def update_problems(path: str, body: Mapping[str, Any]) -> list[str]:
    """Every problem of an update route's ``body`` for ``path``: its schema's, then its buckets' metadata, delta
    header and control channels."""
    problems = field_problems(UPDATE_SCHEMAS.get(path, {}), body)
    if not problems and path == "/update_weights_from_distributed":
        problems += bucket_problems(body) + delta_problems(body.get("weightstream_delta"))
    if not problems and path == "/weightstream/update_weights_from_distributed_ahead":
        problems += buckets_problems(body["buckets"])
    if not problems and path in ("/weightstream/update_weights_from_ipc_ahead", "/weightstream/prepare_ipc_ahead") \
            and any(address_problem(c) for c in body["channels"]):
        problems.append("channels must be 'unix:@NAME' addresses (the trainer ranks' control channels), one per "
                        "engine rank")
    return problems
