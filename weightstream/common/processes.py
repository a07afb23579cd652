"""Processes that die with the process that started them.

A launched rank or an engine worker that outlives its parent holds memory, ports and, for a rank forked from
multiprocessing's fork server, the fork server itself (the server stays up while any process it forked holds
its "alive" pipe). On Linux the kernel can end such a child for us: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``.
The signal follows the parent *thread* that forked the child, so it is asked for only where that thread lives
as long as the child: a rank forked by the fork server (its single thread), a process spawned by the thread
that waits for it, and the fork server itself when the main thread starts it (``launch.process_context``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = [
    "die_with_parent", "is_running", "PRELOAD", "process_context", "start_process_server", "start_process", "free_port"
]


_PR_SET_PDEATHSIG = 1


def die_with_parent(launcher: int | None = None) -> None:
    """Linux: the kernel sends this process SIGKILL when its parent dies, however the parent dies.

    The parent may have died before the request was made, and then nothing would come: so the parent is
    checked right after it, and this process exits at once when the parent has changed or when ``launcher``
    (the pid of the process that asked for this one, where that is not the parent, e.g. behind a fork server)
    is no longer running. Elsewhere than Linux, nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # refused (a seccomp filter): the process lives on as before
    if os.getppid() != parent or (launcher is not None and not is_running(launcher)):
        os._exit(1)


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, dead but not yet reaped, has exited)."""
    if not sys.platform.startswith("linux"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


# What the fork server imports once, so that each process forked from it starts in a fraction of a second
# instead of importing these again (about 6 s each on a 2-core machine). Modules that are not installed
# are skipped.
PRELOAD = [
    "torch", "torch.distributed", "transformers", "safetensors.torch",
    "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen2_moe.modeling_qwen2_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "megatron.core", "megatron.core.models.gpt", "weightstream.checks.megatron_models",
    "weightstream.reference_engine.worker", "weightstream.streaming.stream",
]


def process_context():
    """Where weightstream's processes (launched ranks, engine workers) come from: a fork server that has
    imported torch, transformers and Megatron-Core once (Linux, no CUDA), else spawn.
    ``WEIGHTSTREAM_START_METHOD=spawn`` asks for spawn. Where CUDA is present, importing those modules may
    initialise it in the fork server, and a process forked from it then cannot use CUDA: spawn there.
    A fork server that the main thread starts dies with this process (``weightstream.common.fork_server_guard``)."""
    default = "spawn" if torch.cuda.is_available() else "forkserver"
    method = os.environ.get("WEIGHTSTREAM_START_METHOD", default)
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"WEIGHTSTREAM_START_METHOD must be forkserver or spawn, got {method!r}")
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Has no effect once the server runs (it keeps what it loaded). The guard only where the main thread
        # asks: the kernel's parent-death signal follows the thread that starts the server.
        main = threading.current_thread() is threading.main_thread()
        ctx.set_forkserver_preload(["weightstream.common.fork_server_guard", *PRELOAD] if main else PRELOAD)
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
