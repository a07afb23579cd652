"""Process groups between a trainer and engines, made outside the default world.

Both sides call :func:`init_custom_process_group` with the same address, world size and group
name, concurrently: rank 0 (the trainer's sender) hosts the TCP store, everyone else connects,
and the store is prefixed by the group name (what SGLang's receiver does), so several groups can
share one address. The rendezvous is bounded by ``timeout``: a peer that never comes ends in an
error, not a hang.

The store is made here, explicitly (:func:`tcp_store`), never through torch's ``rendezvous()``:
under ``torchrun`` that function reads ``TORCHELASTIC_USE_AGENT_STORE`` and turns every ``tcp://``
store into a client of the elastic agent's store, so the rank that must host the group's store
would host nothing and its peers would have nothing to connect to.

A group, once formed, is kept: :class:`GroupLayout` says what a sink's group is, from this process's
side, so that a sink whose group would be the very same one takes it over instead of forming it again
(a broadcast from the trainer to one engine rank and a send to that rank need the same two ranks).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, cast
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from weightstream.common.bounds import Deadline

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "log", "GroupError", "GroupLayout", "STORE_ANSWER_GRACE_S", "parse_tcp", "tcp_store", "init_custom_process_group",
    "POLL_S", "WARM_BROADCAST", "WARM_SENDS", "wait_works", "warm_device", "warm_group", "destroy_group"
]


log = logging.getLogger("weightstream")


class GroupError(RuntimeError):
    pass




@dataclass(frozen=True)
class GroupLayout:
    """A weight-update group as this trainer process sees it: two sinks with equal layouts can carry
    their buckets over one group. ``engines``: each engine's URL and the group rank of its TP rank 0."""

    master_address: str
    backend: str
    group_name: str
    timeout_s: float
    world_size: int
    rank: int
    engines: tuple[tuple[str, int], ...]


STORE_ANSWER_GRACE_S = 2.0  # beyond its timeout, how long a store client's connect may take before it is refused


def parse_tcp(init_method: str) -> tuple[str, int]:
    """``tcp://host:port`` (IPv6 hosts in brackets) as ``(host, port)``."""
    parsed = urlparse(init_method)
    if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    return parsed.hostname, parsed.port


def tcp_store(host: str, port: int, *, is_master: bool, world_size: int | None = None,
              timeout: timedelta | float = 60.0) -> dist.TCPStore:
    """A TCP store that this process hosts (``is_master``) or connects to, whatever the launcher set
    in the environment. A client retries until ``timeout``; the host does not wait for anyone.

    torch's client waits without a bound for the first answer of a peer that accepted its connection (a port
    held by something that is not a store, or a store that hangs): it connects on a thread of its own here, and
    a client with no store by ``timeout`` is refused, naming the address (the thread ends when that peer closes
    the connection)."""
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if is_master:
        return dist.TCPStore(host, port, world_size, is_master, timeout, wait_for_workers=False)
    return _bounded_client(host, port, world_size, timeout)


def _bounded_client(host: str, port: int, world_size: int | None, timeout: timedelta) -> dist.TCPStore:
    made: list[dist.TCPStore | BaseException] = []

    def connect() -> None:
        try:
            made.append(dist.TCPStore(host, port, world_size, False, timeout, wait_for_workers=False))
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller
            made.append(exc)

    thread = threading.Thread(target=connect, name=f"tcp-store-client-{host}:{port}", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds() + STORE_ANSWER_GRACE_S)
    if not made:
        raise TimeoutError(f"the store at {host}:{port} took the connection but gave no answer within "
                           f"{timeout.total_seconds():.0f} s (is that port a torch TCPStore?)")
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta | float = 60.0,
):
    """A process group of ``world_size`` ranks that is not part of the default world."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    if not group_name:
        raise ValueError("group_name must not be empty")
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    try:
        host, port = parse_tcp(init_method)
        store = PrefixStore(group_name, tcp_store(host, port, is_master=rank == 0, world_size=world_size,
                                                  timeout=timeout))
        params = inspect.signature(_new_process_group_helper).parameters
        options = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
        if "device_id" in params:
            options["device_id"] = None
        # GroupName: a NewType over str in recent torches; cast, so no torch has to define it at run time
        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), store, group_name=cast("GroupName", group_name), timeout=timeout,
            **options,
        )
    except Exception as exc:  # re-raised with the group named
        raise GroupError(
            f"could not form process group {group_name!r} ({backend}, {init_method}, rank {rank} of {world_size}) "
            f"within {timeout.total_seconds():.0f} s: {exc}"
        ) from exc
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


POLL_S = 50e-6  # how often the host looks whether a transfer on a GPU has finished

# How a group's first, tiny transfer goes (:func:`warm_group`): one broadcast from rank 0, or a send from each of the
# first ``senders`` ranks to every other rank.
WARM_BROADCAST = "broadcast"
WARM_SENDS = "sends"


def wait_works(works: list, on_device: bool, timeout: timedelta) -> None:
    """Until every one of ``works`` (a process group's) has finished, on the host, within ``timeout``. On a GPU the
    finish is polled finely: a wait given a timeout by the process group sleeps a millisecond at a time, which
    leaves the wire idle between buckets."""
    deadline = Deadline(timeout.total_seconds())
    if on_device:
        while not all(w.is_completed() for w in works):
            if deadline.expired:
                raise TimeoutError(f"the transfer did not finish within {deadline.seconds:.1f} s")
            time.sleep(POLL_S)
    for w in works:
        w.wait(deadline.timedelta())  # (on a GPU, finished: raises what it failed with, if anything)


def warm_device(backend: str, gpu: torch.device | None = None) -> torch.device:
    """Where a group of ``backend`` moves its tensors from this process: for NCCL ``gpu`` (default: the current
    GPU), else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    return gpu if gpu is not None else torch.device("cuda", torch.cuda.current_device())


def warm_group(group, how: str, senders: int, device: torch.device, timeout_s: float) -> None:
    """The group's first transfer, one byte (``how``: :data:`WARM_BROADCAST` or :data:`WARM_SENDS`), run by every
    member right after forming it: NCCL makes a group's communicator and its connections on first use, which
    would otherwise fall on the first update (hundreds of milliseconds). Bounded by ``timeout_s``."""
    one = torch.zeros(1, dtype=torch.uint8, device=device)
    if how == WARM_BROADCAST:
        works = [dist.broadcast(one, group=group, group_src=0, async_op=True)]
    elif how == WARM_SENDS:
        rank, world = group.rank(), group.size()  # (its own ranks: the default world maps no custom group)
        peers = range(senders, world) if rank < senders else range(senders)
        # one by one, as the buckets go (a batch of them would use other connections); every rank in the same order
        if rank < senders:
            works = [dist.isend(one, group=group, group_dst=p) for p in peers]
        else:
            works = [dist.irecv(torch.zeros_like(one), group=group, group_src=p) for p in peers]
    else:
        raise ValueError(f"a group is warmed by {WARM_BROADCAST!r} or {WARM_SENDS!r}, not {how!r}")
    wait_works(works, device.type == "cuda", timedelta(seconds=timeout_s))


def destroy_group(group) -> None:
    """Tear a custom group down; never raises (it is called on error paths)."""
    if group is None:
        return
    try:
        dist.destroy_process_group(group)
    except Exception as exc:  # noqa: BLE001 — the peer may be gone
        log.debug("tearing a weight-update group down: %s", exc)
