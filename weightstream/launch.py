"""Run a function on N local processes joined in one ``torch.distributed`` job.

Used by the CLI (``demo``, ``dump``) and the tests: each process initialises the default group
(gloo on the CPU, NCCL when every rank has a GPU), runs ``fn(*args)`` and sends back its result
or its traceback. Every wait is bounded: a process that hangs or dies ends the job with an error
that names the rank.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from weightstream.errors import WeightstreamError
from weightstream.processes import die_with_parent


class LaunchError(RuntimeError):
    """A launched job that failed. ``reasons``: by rank, the message of each rank that failed with a
    :class:`~weightstream.errors.WeightstreamError` (which says all the user needs, without the traceback)."""

    def __init__(self, message: str, reasons: dict[int, str] | None = None):
        super().__init__(message)
        self.reasons = dict(reasons or {})


# What the fork server imports once, so that each process forked from it starts in a fraction of a second
# instead of importing these again (about 6 s each on a 2-core machine). Modules that are not installed
# are skipped.
PRELOAD = [
    "torch", "torch.distributed", "transformers", "safetensors.torch",
    "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen2_moe.modeling_qwen2_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "megatron.core", "megatron.core.models.gpt", "weightstream.models.megatron", "weightstream.engine.worker",
    "weightstream.streaming.stream",
]


def process_context():
    """Where weightstream's processes (launched ranks, engine workers) come from: a fork server that has
    imported torch, transformers and Megatron-Core once (Linux, no CUDA), else spawn.
    ``WEIGHTSTREAM_START_METHOD=spawn`` asks for spawn. Where CUDA is present, importing those modules may
    initialise it in the fork server, and a process forked from it then cannot use CUDA: spawn there.
    A fork server that the main thread starts dies with this process (``weightstream.fork_server_guard``)."""
    default = "spawn" if torch.cuda.is_available() else "forkserver"
    method = os.environ.get("WEIGHTSTREAM_START_METHOD", default)
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"WEIGHTSTREAM_START_METHOD must be forkserver or spawn, got {method!r}")
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Has no effect once the server runs (it keeps what it loaded). The guard only where the main thread
        # asks: the kernel's parent-death signal follows the thread that starts the server.
        main = threading.current_thread() is threading.main_thread()
        ctx.set_forkserver_preload(["weightstream.fork_server_guard", *PRELOAD] if main else PRELOAD)
        return ctx
    return mp.get_context("spawn")


def start_process_server() -> None:
    """Start the fork server now, from the main thread, where :func:`process_context` uses one: it imports its
    preload (several seconds) in its own process while the caller goes on, instead of when the first process
    is asked for."""
    ctx = process_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _in_environment(env: dict[str, str], cwd: str, path: list[str], target: Callable[..., Any], *args: Any) -> None:
    """Run ``target`` with the environment, working directory and ``sys.path`` the parent had when it started
    this process (a process forked from the fork server would otherwise have those of the moment the server
    started)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    target(*args)


def start_process(ctx, target: Callable[..., Any], args: tuple, *, daemon: bool):
    """``target(*args)`` in a new process of ``ctx`` (:func:`process_context`). ``target`` must be importable
    in a fresh interpreter; anything that may not be (a user's function) goes pickled in ``args``."""
    proc = ctx.Process(target=_in_environment, args=(dict(os.environ), os.getcwd(), list(sys.path), target, *args),
                       daemon=daemon)
    proc.start()
    return proc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        from weightstream.streaming.groups import tcp_store

        timeout = timedelta(seconds=timeout_s)
        store = tcp_store("127.0.0.1", port, is_master=rank == 0, world_size=world, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        try:
            value = fn(*args)
            # Pickled here, tensors by value: a tensor sent through the queue as shared memory would need
            # this process alive until the parent has read it.
            results.put((rank, True, pickle.dumps(value)))
        finally:
            try:
                from megatron.core import parallel_state as ps

                ps.destroy_model_parallel()
            except Exception:
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
    got: dict[int, tuple[bool, Any]] = {}
    import time

    deadline = time.monotonic() + timeout_s
    try:
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
    finally:
        for p in procs:
            p.join(timeout=5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    if failed:
        raise LaunchError(_failures(got).lstrip("\n"), _reasons(got))
    return [pickle.loads(got[r][1]) for r in range(world_size)]


def _failures(got: dict[int, tuple[bool, Any]]) -> str:
    failed = {r: v for r, (ok, v) in sorted(got.items()) if not ok}
    if not failed:
        return ""
    return "\n" + "\n".join(f"rank {r} failed:\n{tb}" for r, (tb, _) in failed.items())


def _reasons(got: dict[int, tuple[bool, Any]]) -> dict[int, str]:
    return {r: v[1] for r, (ok, v) in sorted(got.items()) if not ok and v[1] is not None}
