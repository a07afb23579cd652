"""Run a function on N local processes joined in one ``torch.distributed`` job.

Used by the CLI (``demo``, ``dump``) and the tests: each process initialises the default group
(gloo on the CPU, NCCL when every rank has a GPU), runs ``fn(*args)`` and sends back its result
or its traceback. Every wait is bounded: a process that hangs or dies ends the job with an error
that names the rank.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from weightstream.common.processes import (
    die_with_parent,
    free_port,
    process_context,
    start_process,
    start_process_server,
)
from weightstream.errors import WeightstreamError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

__all__ = ["LaunchError", "free_port", "launch", "start_process_server"]


class LaunchError(RuntimeError):
    """A launched job that failed. ``reasons``: by rank, the message of each rank that failed with a
    :class:`~weightstream.errors.WeightstreamError` (which says all the user needs, without the traceback)."""

    def __init__(self, message: str, reasons: dict[int, str] | None = None):
        super().__init__(message)
        self.reasons = dict(reasons or {})


def _worker(launcher: int, rank: int, world: int, port: int, backend: str, timeout_s: float, job: bytes,
            results) -> None:
    die_with_parent(launcher)  # a SIGKILLed launcher leaves no rank waiting out its collectives' timeout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(job)  # here, once this process has the parent's sys.path
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        from weightstream.wire.groups import tcp_store

        timeout = timedelta(seconds=timeout_s)
        store = tcp_store("127.0.0.1", port, is_master=rank == 0, world_size=world, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        try:
            value = fn(*args)
            # Serialized here, tensors by value: a tensor sent through the queue as shared memory would need
            # this process alive until the parent has read it.
            results.put((rank, True, _dumps(value)))
        finally:
            try:
                from megatron.core import parallel_state as ps

                ps.destroy_model_parallel()
            except Exception:  # noqa: BLE001 -- tearing down: the rank's own result or error is what is reported
                pass
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 — the parent reports it
        reason = str(exc) if isinstance(exc, WeightstreamError) else None
        results.put((rank, False, (traceback.format_exc(), reason)))


def launch(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes; return their results by rank.

    ``fn`` must be importable by name (a module-level function). Raises :class:`LaunchError`
    with each failing rank's traceback, or naming the ranks that did not answer in time.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    ctx = process_context()
    results = ctx.Queue()
    port = free_port()
    job = pickle.dumps((fn, args))
    procs = [start_process(ctx, _worker, (os.getpid(), r, world_size, port, backend, timeout_s, job, results),
                           daemon=False)
             for r in range(world_size)]
    try:
        got = _collect(results, procs, timeout_s)
    finally:
        _reap(procs)
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    if failed:
        raise LaunchError(_failures(got).lstrip("\n"), _reasons(got))
    return [_loads(got[r][1]) for r in range(world_size)]


def _dumps(value: Any) -> bytes:
    """A rank's result as bytes: torch's own format, which holds tensors of every dtype (plain pickle cannot
    rebuild a float8 tensor)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    """A result from one of this job's own ranks (any object they returned, as pickle would give it)."""
    return torch.load(io.BytesIO(data), weights_only=False)


def _collect(results: Queue[Any], procs: list[BaseProcess], timeout_s: float) -> dict[int, tuple[bool, Any]]:
    """Every rank's answer ``(ok, pickled value or (traceback, reason))``, by rank. Raises :class:`LaunchError`
    when a rank does not answer within ``timeout_s`` (10 s once another rank has failed) or exits without."""
    world_size = len(procs)
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(got))
            raise LaunchError(f"ranks {missing} did not finish within {timeout_s:.0f} s" + _failures(got),
                              _reasons(got))
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
            got[rank] = (ok, value)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                # Give a dying rank's traceback a moment to arrive before calling it dead.
                try:
                    rank, ok, value = results.get(timeout=2.0)
                    got[rank] = (ok, value)
                    continue
                except queue.Empty:
                    raise LaunchError(
                        f"ranks {dead} exited (codes {[procs[r].exitcode for r in dead]}) without a result"
                        + _failures(got), _reasons(got)
                    ) from None
        if any(not ok for ok, _ in got.values()) and len(got) < world_size:
            # One rank failed: the others may be stuck in a collective with it; don't wait long.
            deadline = min(deadline, time.monotonic() + 10.0)
    return got


def _reap(procs: list[BaseProcess]) -> None:
    """Wait a little for every process to end, then kill those still running."""
    for p in procs:
        p.join(timeout=5.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def _failures(got: dict[int, tuple[bool, Any]]) -> str:
    failed = {r: v for r, (ok, v) in sorted(got.items()) if not ok}
    if not failed:
        return ""
    return "\n" + "\n".join(f"rank {r} failed:\n{tb}" for r, (tb, _) in failed.items())


def _reasons(got: dict[int, tuple[bool, Any]]) -> dict[int, str]:
    return {r: v[1] for r, (ok, v) in sorted(got.items()) if not ok and v[1] is not None}
