"""The engine's side of a colocated update's control channel (:mod:`weightstream.wire.channel`): the trainer's next
frame taken as the kind it must be, a failure answered with an :class:`~weightstream.wire.frames.Error` frame before
it is raised, and the descriptors that come with a frame closed once it is handled."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from weightstream.wire.channel import Channel, ChannelError
from weightstream.wire.frames import Error, Frame, FrameError, expect

__all__ = ["F", "MAX_ERROR_CHARS", "closing", "answer_error", "failures_answered", "receive_frame", "receive_one",
           "close_fds"]

F = TypeVar("F", bound=Frame)
MAX_ERROR_CHARS = 4000  # of the reason an error frame gives


@contextmanager
def closing(fds: list[int]) -> Iterator[None]:
    """Descriptors that came with a frame are closed once it is handled (what was mapped keeps its own)."""
    try:
        yield
    finally:
        close_fds(fds)


def answer_error(chan: Channel, reason: str, bucket: int | None = None) -> None:
    """Tell the trainer why this update ends here (an :class:`Error` frame), where the channel still takes it."""
    try:
        chan.send(Error(reason[:MAX_ERROR_CHARS], bucket))
    except ChannelError:
        pass  # the trainer is gone: its end of the update has ended already


@contextmanager
def failures_answered(chan: Channel, bucket: int | None = None):
    """A failure inside is answered on the control channel (an :class:`Error` frame naming ``bucket``), then
    raised."""
    try:
        yield
    except Exception as exc:
        answer_error(chan, f"{type(exc).__name__}: {exc}", bucket)
        raise


def receive_frame(chan: Channel, kind: type[F], timeout_s: float, what: str, bucket: int | None = None,
                  ) -> tuple[F, list[int]]:
    """The trainer's next frame, which must be a ``kind``, and the descriptors that came with it. A frame
    that is malformed, or of another kind, is answered with an :class:`Error` frame naming the problem and
    raised (:class:`FrameError`); the trainer's own :class:`Error` frame is raised, not answered."""
    try:
        frame, fds = chan.recv_fds(timeout_s, what)
    except FrameError as exc:
        answer_error(chan, f"{what}: {exc}", bucket)
        raise
    if isinstance(frame, Error):
        close_fds(fds)
        raise RuntimeError(f"the trainer gave the update up ({what}): {frame.message}")
    try:
        return expect(frame, kind, what), fds
    except FrameError as exc:
        close_fds(fds)
        answer_error(chan, str(exc), bucket)
        raise


def receive_one(chan: Channel, kind: type[F], timeout_s: float, what: str) -> F:
    """:func:`receive_frame` of a frame that comes with no descriptors (any that came are closed, and refused)."""
    frame, fds = receive_frame(chan, kind, timeout_s, what)
    if fds:
        close_fds(fds)
        problem = f"{what}: {len(fds)} descriptors came with a {kind.kind!r} frame, which takes none"
        answer_error(chan, problem)
        raise FrameError(kind.kind, [problem])
    return frame


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
