"""What the engine's server and each of its worker processes say to each other over their pipe: the server sends
one :class:`Command` at a time, and the worker answers each with one :class:`Reply` that carries the command's
id back. The server matches a reply to its command by that id: a reply to a command it gave up on (the worker
answered past the bound) is read, logged and dropped, never taken for the answer to a later command."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["START_ID", "Command", "OutOfTime", "Outcome", "Reply"]

START_ID = 0  # the id of the reply a worker sends once it has started (ready, or why it could not start)


class Outcome(enum.Enum):
    DONE = "done"  # the command ran; ``result`` is what it returned
    FAILED = "failed"  # it raised; ``result`` is the error's text
    OUT_OF_TIME = "out_of_time"  # it stopped at its deadline (:class:`OutOfTime`); ``result`` says where


@dataclass(frozen=True, slots=True)
class Command:
    """One command to one worker: the name of one of its commands (``Worker.commands()``) and its arguments."""

    id: int  # the server's number for it, from 1 up, never reused in one engine
    name: str
    args: dict[str, Any] = field(default_factory=dict)
    # time.monotonic() (one clock for every process of the host) past which long work stops between two of its
    # steps (:class:`OutOfTime`); None: no deadline
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """A worker's answer to the command of the same ``id`` (:data:`START_ID`: to its start)."""

    id: int
    outcome: Outcome
    result: Any


class OutOfTime(RuntimeError):
    """Raised in a worker by work that reached its command's deadline; the text says how far it got."""
