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
import sys

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
