"""What the engine's server and each of its worker processes say to each other over their pipe: the server sends
one :class:`Command` at a time, carrying one typed request (a frozen dataclass below, or a receive of
:mod:`weightstream.receiver.plan`) that the worker dispatches by its type, and the worker answers each with one
:class:`Reply` that carries the command's id back. The server matches a reply to its command by that id: a reply
to a command it gave up on (the worker answered past the bound) is read, logged and dropped, never taken for the
answer to a later command."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from weightstream.receiver.plan import IpcReceive, Receive, TensorReceive

__all__ = [
    "START_ID", "InitGroup", "DestroyGroup", "DestroyAllGroups", "ReleaseIpc", "BeginSession", "PrepareSession",
    "CommitSession", "AbortSession", "ForgetDelta", "DeltaChecksums", "UpdatePhases", "ReleaseMemory",
    "ResumeMemory", "Memory", "Logits", "Generate", "Layout", "WeightChecksums", "Shutdown", "Request", "name_of",
    "Command", "OutOfTime", "Outcome", "Reply"
]

START_ID = 0  # the id of the reply a worker sends once it has started (ready, or why it could not start)


class Outcome(enum.Enum):
    DONE = "done"  # the command ran; ``result`` is what it returned
    FAILED = "failed"  # it raised; ``result`` is the error's text
    OUT_OF_TIME = "out_of_time"  # it stopped at its deadline (:class:`OutOfTime`); ``result`` says where


@dataclass(frozen=True, slots=True)
class InitGroup:
    """Join a weight-update group; ``warm``: then run its first, tiny transfer with the trainer."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    warm: str = ""
    warm_senders: int = 1


@dataclass(frozen=True, slots=True)
class DestroyGroup:
    group_name: str


@dataclass(frozen=True, slots=True)
class DestroyAllGroups:
    pass


@dataclass(frozen=True, slots=True)
class ReleaseIpc:
    """Close the buffers trainer ``client`` kept mapped."""

    client: str


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
class ReleaseMemory:
    tags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ResumeMemory:
    tags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Memory:
    pass


@dataclass(frozen=True, slots=True)
class Logits:
    input_ids: list[list[int]]


@dataclass(frozen=True, slots=True)
class Generate:
    rows: list[list[int]]
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class Layout:
    pass


@dataclass(frozen=True, slots=True)
class WeightChecksums:
    names: list[str]


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Request = (InitGroup | DestroyGroup | DestroyAllGroups | ReleaseIpc | BeginSession | PrepareSession | CommitSession
           | AbortSession | ForgetDelta | DeltaChecksums | UpdatePhases | ReleaseMemory | ResumeMemory | Memory | Logits
           | Generate | Layout | WeightChecksums | Shutdown | Receive | IpcReceive | TensorReceive)


def name_of(request: Any) -> str:
    """How logs and errors name a request: its type's name in words (``InitGroup``: ``init_group``), a receive by
    its plan."""
    if isinstance(request, Receive):
        plan = request.plan
        return f"receive ({plan.transport.value}{', ahead' if plan.ahead else ''}{', delta' if plan.delta else ''})"
    name = type(request).__name__
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
