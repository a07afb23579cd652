"""What the engine's server and each of its worker processes say to each other over their pipe: the server sends
one :class:`Command` at a time, carrying one typed request (a frozen dataclass below, a receive of
:mod:`weightstream.receiver.plan`, or a route's request as the HTTP face decoded it: joining or leaving a group,
releasing a trainer's IPC buffers, releasing or resuming memory, logits, checksums of the weights) that the worker
dispatches by its type, and the worker answers each with one :class:`Reply` that carries the command's id back. The
server matches a reply to its command by that id: a reply to a command it gave up on (the worker answered past the
bound) is read, logged and dropped, never taken for the answer to a later command.

Below the commands, the requests of the engine's own serving (``/generate``, ``/weightstream/logits``, the memory
routes' tags), each decoded from an HTTP body in one step that lists every problem, as the shared requests of
:mod:`weightstream.receiver.requests` are."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

from weightstream.receiver.plan import IpcReceive, Receive, TensorReceive
from weightstream.receiver.requests import (
    DestroyGroupRequest,
    InitGroupRequest,
    ReleaseIpcRequest,
    RequestError,
    Schema,
    WeightChecksumsRequest,
    field_problems,
    refuse,
)
from weightstream.receiver.schema import token_rows

__all__ = [
    "START_ID", "DestroyAllGroups", "BeginSession", "PrepareSession", "CommitSession", "AbortSession", "ForgetDelta",
    "DeltaChecksums", "UpdatePhases", "Memory", "Generate", "Layout", "Shutdown",
    "Request", "name_of", "Command", "OutOfTime", "Outcome", "Reply", "MEMORY_TAGS", "ReleaseMemoryRequest",
    "ResumeMemoryRequest", "GenerateRequest", "LogitsRequest"
]

START_ID = 0  # the id of the reply a worker sends once it has started (ready, or why it could not start)


class Outcome(enum.Enum):
    DONE = "done"  # the command ran; ``result`` is what it returned
    FAILED = "failed"  # it raised; ``result`` is the error's text
    OUT_OF_TIME = "out_of_time"  # it stopped at its deadline (:class:`OutOfTime`); ``result`` says where


@dataclass(frozen=True, slots=True)
class DestroyAllGroups:
    pass


@dataclass(frozen=True, slots=True)
class BeginSession:
    pass


@dataclass(frozen=True, slots=True)
class PrepareSession:
    pass


@dataclass(frozen=True, slots=True)
class CommitSession:
    pass


@dataclass(frozen=True, slots=True)
class AbortSession:
    pass


@dataclass(frozen=True, slots=True)
class ForgetDelta:
    pass


@dataclass(frozen=True, slots=True)
class DeltaChecksums:
    pass


@dataclass(frozen=True, slots=True)
class UpdatePhases:
    pass


@dataclass(frozen=True, slots=True)
class Memory:
    pass


@dataclass(frozen=True, slots=True)
class Generate:
    rows: list[list[int]]
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class Layout:
    pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


def name_of(request: Any) -> str:
    """How logs and errors name a request: its type's name in words, less ``Request`` (``InitGroupRequest``:
    ``init_group``), a receive by its plan."""
    if isinstance(request, Receive):
        plan = request.plan
        return f"receive ({plan.transport.value}{', ahead' if plan.ahead else ''}{', delta' if plan.delta else ''})"
    name = type(request).__name__.removesuffix("Request")
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


@dataclass(frozen=True, slots=True)
class Command:
    """One command to one worker: its typed request (the worker dispatches it by its type)."""

    id: int  # the server's number for it, from 1 up, never reused in one engine
    request: Any  # a :data:`Request`
    # time.monotonic() (one clock for every process of the host) past which long work stops between two of its
    # steps (:class:`OutOfTime`); None: no deadline
    deadline: float | None = None

    @property
    def name(self) -> str:
        return name_of(self.request)


@dataclass(frozen=True, slots=True)
class Reply:
    """A worker's answer to the command of the same ``id`` (:data:`START_ID`: to its start)."""

    id: int
    outcome: Outcome
    result: Any


class OutOfTime(RuntimeError):
    """Raised in a worker by work that reached its command's deadline; the text says how far it got."""


# -- the HTTP requests of the engine's own serving, decoded into the commands above --------------------------

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def _memory_tags(route: str, schema: Schema, body: dict) -> tuple[str, ...]:
    refuse(route, field_problems(schema, body))
    tags = body.get("tags") or list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise RequestError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return tuple(tags)


@dataclass(frozen=True, slots=True)
class ReleaseMemoryRequest:
    """``/release_memory_occupation``: what to free (``tags``, of :data:`MEMORY_TAGS`; none given: all)."""

    ROUTE: ClassVar[str] = "/release_memory_occupation"
    FIELDS: ClassVar[Schema] = {"tags": ((list, type(None)), False)}

    tags: tuple[str, ...] = MEMORY_TAGS

    @classmethod
    def decode(cls, body: dict) -> ReleaseMemoryRequest:
        return cls(_memory_tags(cls.ROUTE, cls.FIELDS, body))


@dataclass(frozen=True, slots=True)
class ResumeMemoryRequest:
    """``/resume_memory_occupation``: what to re-create (``tags``, of :data:`MEMORY_TAGS`; none given: all)."""

    ROUTE: ClassVar[str] = "/resume_memory_occupation"
    FIELDS: ClassVar[Schema] = {"tags": ((list, type(None)), False)}

    tags: tuple[str, ...] = MEMORY_TAGS

    @classmethod
    def decode(cls, body: dict) -> ResumeMemoryRequest:
        return cls(_memory_tags(cls.ROUTE, cls.FIELDS, body))


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """``/generate``: rows of token ids, ``max_new_tokens`` (``sampling_params``, default 16) each; ``one_row``:
    SGLang's one list of ids, answered as one output rather than a list."""

    ROUTE: ClassVar[str] = "/generate"
    FIELDS: ClassVar[Schema] = {"input_ids": ((list,), True), "sampling_params": ((dict, type(None)), False)}

    rows: tuple[tuple[int, ...], ...]
    one_row: bool = False
    max_new_tokens: int = 16

    @classmethod
    def decode(cls, body: dict) -> GenerateRequest:
        refuse(cls.ROUTE, field_problems(cls.FIELDS, body))
        rows = token_rows(body["input_ids"], flat=True)
        if isinstance(rows, str):
            raise RequestError(f"bad request to {cls.ROUTE}: {rows}")
        n = (body.get("sampling_params") or {}).get("max_new_tokens", 16)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 4096:
            raise RequestError(f"sampling_params.max_new_tokens must be an integer in [0, 4096], got {n!r}")
        return cls(tuple(tuple(r) for r in rows), not isinstance(body["input_ids"][0], list), n)


@dataclass(frozen=True, slots=True)
class LogitsRequest:
    """``/weightstream/logits``: rows of token ids, all of one length."""

    ROUTE: ClassVar[str] = "/weightstream/logits"
    FIELDS: ClassVar[Schema] = {"input_ids": ((list,), True)}

    rows: tuple[tuple[int, ...], ...]

    @classmethod
    def decode(cls, body: dict) -> LogitsRequest:
        refuse(cls.ROUTE, field_problems(cls.FIELDS, body))
        rows = token_rows(body["input_ids"], flat=False)
        if isinstance(rows, str):
            raise RequestError(f"bad request to {cls.ROUTE}: {rows}")
        refuse(cls.ROUTE, ["the rows of input_ids must have one length"] if len({len(r) for r in rows}) != 1 else [])
        return cls(tuple(tuple(r) for r in rows))


# The requests of the group, IPC and memory routes are the worker's commands as the HTTP face decodes them.
Request = (InitGroupRequest | DestroyGroupRequest | DestroyAllGroups | ReleaseIpcRequest | BeginSession
           | PrepareSession | CommitSession | AbortSession | ForgetDelta | DeltaChecksums | UpdatePhases
           | ReleaseMemoryRequest | ResumeMemoryRequest | Memory | LogitsRequest | Generate | Layout
           | WeightChecksumsRequest | Shutdown | Receive | IpcReceive | TensorReceive)
