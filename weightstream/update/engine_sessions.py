"""The engines of a :class:`~weightstream.update.WeightSync` and their update sessions: made from URLs once (rank 0
asks what each is; every rank makes the same adapters), then, on rank 0, paused and opened, committed (in two
phases where several engines take it), resumed, or aborted within the cleanup budget."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from weightstream.common.bounds import Deadline, cleanup_budget
from weightstream.engines import detect, make_adapter
from weightstream.engines.base import (
    COMMIT_AND_RESUME,
    PAUSE_AND_BEGIN,
    PREPARE_COMMIT,
    RELEASE_MEMORY,
    ROLLBACK,
    CommitsAndResumes,
    EngineAdapter,
    MemoryEngine,
    PausesAndBegins,
    PreparesCommits,
    capable,
    implementing,
    require,
)
from weightstream.errors import UpdateError
from weightstream.update.options import EngineOptions
from weightstream.update.ranks import as_update_error, committed_on, rank, share

__all__ = ["EngineSessions"]

log = logging.getLogger("weightstream")


class EngineSessions:
    """The engines given (adapters, or URLs whose adapters :meth:`resolve` makes) and what rank 0 asks of them
    around an update. ``released``: the memory they gave up (:meth:`release`), re-created by the next update."""

    def __init__(self, given: list[EngineAdapter | str], reach: EngineOptions, pause_mode: str):
        self.given = given
        self.reach = reach
        self.pause_mode = pause_mode
        self.engines: list[EngineAdapter] = []  # made by resolve on the first update
        self.released: list[str] = []

    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def resolve(self) -> None:
        """Adapters for engines given by URL: rank 0 asks each engine what it is (``engine="auto"``),
        every rank makes the same adapters."""
        if self.engines:
            return
        urls = [u for u in self.given if isinstance(u, str)]
        kinds: Any = None
        if urls and rank() == 0:
            try:
                kinds = [self.reach.engine if self.reach.engine != "auto" else
                         detect(u, api_key=self.reach.api_key, timeout_s=self.reach.timeout_s) for u in urls]
            except Exception as exc:  # noqa: BLE001 — shared with every rank below
                kinds = as_update_error("connect", exc, urls)
        if urls:
            kinds = share(kinds)
        if isinstance(kinds, BaseException):
            raise kinds
        options = self.reach.adapter_options()
        made = iter(make_adapter(k, u, **options) for k, u in zip(kinds or [], urls, strict=True))
        self.engines = [next(made) if isinstance(e, str) else e for e in self.given]

    def pause(self, version: str) -> None:
        """Rank 0: pause generation and open every engine's session (weights released by :meth:`release`
        are re-created first, before the update writes into them)."""
        timeout_s = self.reach.timeout_s
        if "weights" not in self.released:
            for e in self.engines:
                _pause_and_begin(e, self.pause_mode, version, timeout_s)
            return
        for e in self.engines:
            e.pause(self.pause_mode)
        for e in self.engines:
            _memory(e).resume_memory(["weights"])
        for e in self.engines:
            e.begin_update(version, timeout_s)

    def commit(self, version: str, seconds: dict[str, float]) -> tuple[BaseException | None, bool]:
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
                                      f"{version!r}", self.urls())
            for e in self.engines if rest else ():
                _memory(e).resume_memory(rest)
        except Exception as exc:  # noqa: BLE001 — shared with every rank
            return committed_on(as_update_error("commit", exc, self.urls()), committed, self.urls()), False
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
                              "committed", self.urls())
        return {p.url for p in preparing}

    def resume(self, seconds: dict[str, float]) -> None:
        """Rank 0: generation resumes on every engine (best effort: the update is committed)."""
        t = time.perf_counter()
        for e in self.engines:
            try:
                e.resume(timeout_s=self.reach.timeout_s)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not resume generation on %s: %s", e.url, exc)
        seconds["resume"] = time.perf_counter() - t

    def release(self, tags: Sequence[str]) -> None:
        """Rank 0: pause generation and have every engine free the memory of ``tags`` (raised, not shared)."""
        unable = [e.url for e in self.engines if not e.info().can(RELEASE_MEMORY)]
        if unable:
            raise ValueError(f"engines {unable} cannot release their memory")
        for e in self.engines:
            e.pause(self.pause_mode)
            _memory(e).release_memory(list(tags))

    def abort(self, seconds: float | None = None, resume_stale: bool = True) -> None:
        """Close every engine's session without committing, then resume generation; within ``seconds``
        (the cleanup budget by default), best effort: an engine that cannot answer gives its session
        up by itself after the bound it was given at ``begin``. ``resume_stale`` False: an engine that does not
        declare ``rollback`` (what the session loaded stays) is left paused, for an update that follows at once."""
        deadline = Deadline(cleanup_budget(self.reach.timeout_s) if seconds is None else seconds)
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


def _pause_and_begin(engine: EngineAdapter, mode: str, version: str, timeout_s: float) -> None:
    """Pause generation and open a versioned update session: one request where the engine takes both."""
    both = capable(engine, PAUSE_AND_BEGIN, PausesAndBegins)
    if both is not None:
        both.pause_and_begin(mode, version, timeout_s)
        return
    engine.pause(mode)
    engine.begin_update(version, timeout_s)


def _memory(engine: EngineAdapter) -> MemoryEngine:
    return require(engine, RELEASE_MEMORY, MemoryEngine, "release_memory")
