"""The reference engine's ranks: one worker process per engine TP rank, the commands the HTTP routes run on all of
them (:meth:`Engine.call`: one command at a time, each answer matched to its command, a rank that owes an answer
taking none until it comes), and the update session across them (begin, prepare, commit, abort; an idle one rolled
back by its bound: :meth:`Engine.watch_sessions`)."""

from __future__ import annotations

import fcntl
import ipaddress
import itertools
import json
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from weightstream.common.processes import free_port, process_context, start_process
from weightstream.receiver.schema import duration_problem, ep_problem
from weightstream.receiver.values import DEFAULT_CHECKS, LoadChecks
from weightstream.reference_engine.protocol import (
    START_ID,
    AbortSession,
    BeginSession,
    Command,
    CommitSession,
    DestroyAllGroups,
    ForgetDelta,
    Outcome,
    PrepareSession,
    Reply,
    Shutdown,
    name_of,
)
from weightstream.reference_engine.worker import worker_main
from weightstream.wire.handles import gpu_uuid

__all__ = [
    "log", "SESSION_GRACE_S", "EngineFailure", "UpdateInFlight", "EngineUnavailable", "WorkOutOfTime", "Unanswered",
    "gloo_interface", "Engine",
]


def log(message: str) -> None:
    print(f"weightstream engine: {message}", file=sys.stderr, flush=True)


# A session whose trainer has been silent for its bound T plus this is rolled back (finished by T + 2 s).
SESSION_GRACE_S = 1.0


class EngineFailure(RuntimeError):
    """A request the engine could not carry out (reported as success=false)."""


class UpdateInFlight(EngineFailure):
    """A read of the weights while an update session has loaded part of an update (HTTP 409)."""


class EngineUnavailable(EngineFailure):
    """The engine takes no command now: a worker has not answered an earlier one within its bound, or is not
    running (HTTP 503; nothing of the request was run)."""


class WorkOutOfTime(EngineFailure):
    """A command's work reached its deadline on the workers and stopped (the worker's text says where)."""


@dataclass(frozen=True, slots=True)
class Unanswered:
    """A command a worker was sent and has not answered yet; ``given_up``: when the server stopped waiting for the
    answer (None: it still waits)."""

    command: Command
    sent: float  # time.monotonic()
    given_up: float | None = None


_SIOCGIFADDR = 0x8915


def _ipv4_address(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def gloo_interface(host: str) -> str | None:
    """The network interface holding ``host``'s (IPv4) address: where the workers' gloo listeners go
    (``GLOO_SOCKET_IFNAME``), so that they are reachable where the HTTP server is and nowhere else. None
    for a wildcard host, or an address no interface holds (gloo then picks by the machine's hostname)."""
    if host in ("", "0.0.0.0", "::"):
        return None
    try:
        wanted = {ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(host, None, socket.AF_INET)}
    except socket.gaierror:
        return None
    for _, name in socket.if_nameindex():
        address = _ipv4_address(name)
        if address is None:
            continue
        mine = ipaddress.ip_address(address)
        if mine in wanted or (mine.is_loopback and any(a.is_loopback for a in wanted)):
            return name
    return None


def _devices(device: str | None, tp: int) -> list[str]:
    """Each rank's device: ``device`` for all (``cuda``: one GPU each, in turn), or one per rank
    (``"cuda:2,cuda:3"``); by default a GPU where there is one."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if "," in device:
        devices = [d.strip() for d in device.split(",")]
        if len(devices) != tp:
            raise ValueError(f"{len(devices)} devices given for engine TP {tp}: {device!r}")
        return devices
    return [f"cuda:{r % torch.cuda.device_count()}" if device == "cuda" else device for r in range(tp)]


class Engine:
    """The worker processes of one engine and the state the HTTP routes act on."""

    def __init__(self, model_dir: str, tp: int = 1, *, device: str | None = None, dtype: str = "float32",
                 command_timeout_s: float = 300.0, start_timeout_s: float = 300.0, rollback: bool = True,
                 host: str = "127.0.0.1", worker: Callable[..., None] = worker_main, ep: int = 1,
                 checks: LoadChecks = DEFAULT_CHECKS):
        """``host``: the address the HTTP server is bound to; the workers' gloo listeners go on its interface.
        ``worker``: each worker process's entry, called with :func:`~weightstream.reference_engine.worker.
        worker_main`'s arguments (it must be importable in a fresh interpreter). ``ep``: expert parallelism over
        the TP group (1, or ``tp``: each rank holds its routed experts whole, as SGLang's ``--ep-size`` and vLLM's
        ``--enable-expert-parallel`` do). ``checks``: what the values of an update are checked for
        (:class:`LoadChecks`: ``--refuse-nonfinite``)."""
        if (problem := ep_problem(ep, tp)) is not None:
            raise ValueError(problem)
        self.checks = checks
        self.model_dir = os.path.abspath(model_dir)
        self.tp, self.ep = tp, ep
        self.rollback = rollback  # keep what a session overwrites, to put it back if the session is aborted
        self._read_config()
        self.dtype = dtype
        self.devices = _devices(device, tp)
        self.backend = "nccl" if self.devices[0].startswith("cuda") else "gloo"
        self.command_timeout_s = command_timeout_s
        self.weight_version = "default"
        self.paused = threading.Event()
        self.pending_version: str | None = None
        self.session_open = False
        self.session_failed: str | None = None
        self.session_loaded = 0
        self.session_touched = False  # a load of the open session has started: the weights may be half-updated
        self.session_timeout_s = command_timeout_s
        self.lock = threading.Lock()  # one command at a time through the workers
        self.session_lock = threading.RLock()  # begin / commit / abort, one at a time
        self.busy = 0
        self.last_activity = time.monotonic()
        self.stopping = False
        self.weights_released = False  # until an update has loaded every weight again
        # Delta updates: this running engine's name (a restarted one has another), the version whose buckets
        # the workers hold to apply deltas to (None: none), and what the open session loaded: delta buckets,
        # other buckets (those leave the held bytes behind the weights: they are dropped at the commit).
        self.instance = uuid.uuid4().hex[:16]
        self.delta_version: str | None = None
        self.session_delta = self.session_plain = False
        self._start_workers(worker, host, start_timeout_s)

    def _read_config(self) -> None:
        """What the HTTP routes check requests against: the vocabulary size and the longest row."""
        with open(os.path.join(self.model_dir, "config.json")) as f:
            config = json.load(f)
        vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        if vocab_size is None:
            raise ValueError(f"{self.model_dir}/config.json names no vocab_size")
        self.vocab_size = int(vocab_size)
        # a quantized model's (block FP8: the engine holds float8 values and scales, and takes updates in FP8)
        self.quantization_config: dict | None = config.get("quantization_config")
        positions = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
            "max_position_embeddings")
        self.max_positions: int | None = int(positions) if positions else None  # tokens of one row, new ones included

    def _start_workers(self, worker: Callable[..., None], host: str, start_timeout_s: float) -> None:
        """One process per rank, each answering "ready" within ``start_timeout_s`` (else all are stopped)."""
        ctx = process_context()
        port = free_port()
        interface = gloo_interface(host)
        if interface is None and host not in ("", "0.0.0.0", "::"):
            log(f"no network interface holds {host}'s address: the workers' gloo listeners go where gloo's default "
                "puts them")
        self.conns, self.procs = [], []
        self.command_ids = itertools.count(1)  # one id per command, carried back by each worker's reply
        self.unanswered: list[Unanswered | None] = [None] * self.tp  # by rank
        for rank in range(self.tp):
            parent, child = ctx.Pipe()
            proc = start_process(ctx, worker,
                                 (rank, self.tp, self.model_dir, port, self.backend, self.devices[rank], self.dtype,
                                  child, self.rollback, interface, self.ep, self.checks), daemon=True)
            self.conns.append(parent)
            self.procs.append(proc)
        deadline = time.monotonic() + start_timeout_s
        for rank, conn in enumerate(self.conns):
            reply = self._recv(rank, conn, deadline - time.monotonic(), "start")
            if reply.id != START_ID or reply.outcome is not Outcome.DONE:
                self.shutdown()
                raise EngineFailure(f"engine rank {rank} failed to start:\n{reply.result}")

    def _recv(self, rank: int, conn, timeout: float, what: str) -> Reply:
        step = 0.5
        waited = 0.0
        while not conn.poll(min(step, max(timeout, 0.0))):
            waited += step
            if not self.procs[rank].is_alive():
                raise EngineFailure(f"engine rank {rank} died (exit code {self.procs[rank].exitcode}) during {what}")
            if waited >= timeout:
                raise EngineFailure(f"engine rank {rank} did not answer {what} within {timeout:.0f} s")
        try:
            reply = conn.recv()
        except (EOFError, OSError):
            self.procs[rank].join(timeout=5)
            raise EngineFailure(
                f"engine rank {rank} died (exit code {self.procs[rank].exitcode}) during {what}"
            ) from None
        if not isinstance(reply, Reply):
            raise EngineFailure(f"engine rank {rank} sent a {type(reply).__name__} where a reply was due ({what})")
        return reply

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def call(self, request: Any, *, wait_s: float | None = None, committed: bool = False,
             work_s: float | None = None) -> list[Any]:
        """Run ``request`` (a :data:`~weightstream.reference_engine.protocol.Request`; a list: one per worker) on every
        worker; returns their results or raises naming the failing ranks.
        Waits at most ``wait_s`` (default ``command_timeout_s``) for the workers to be free, and as
        long again for their answers. ``committed``: the command reads the weights, and must see the
        committed ones only (:class:`UpdateInFlight` while an open session has started loading).
        ``work_s``: the workers stop the command's work past this many seconds (:class:`WorkOutOfTime`).
        A worker that has not answered an earlier command it was given up on takes none
        (:class:`EngineUnavailable`, nothing sent) until its late answer has come and been dropped."""
        timeout = self.command_timeout_s if wait_s is None else wait_s
        if self.stopping:
            raise EngineFailure("the engine is shutting down")
        if committed:
            self.check_settled()
        if not self.lock.acquire(timeout=timeout):
            raise EngineFailure(f"{name_of(request[0] if isinstance(request, list) else request)}: the workers "
                                f"stayed busy for {timeout:.0f} s")
        self.busy += 1
        try:
            if committed:
                self.check_settled()  # again, holding the workers: a load that started meanwhile is seen
            self._drop_late_replies()
            if (problem := self.unanswered_problem()) is not None:
                raise EngineUnavailable(problem)
            sent = self._send(request, work_s)
            deadline = time.monotonic() + timeout
            replies = [self._reply(rank, c, deadline) for rank, c in enumerate(sent)]
        finally:
            self._give_up()
            self.busy -= 1
            self.last_activity = time.monotonic()
            self.lock.release()
        return _results(replies)

    def _send(self, request: Any, work_s: float | None) -> list[Command]:
        """Send one command (one id) to every worker, each its own request where ``request`` is a list of them."""
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise EngineFailure(f"engine rank {rank} is not running (exit code {proc.exitcode})")
        number = next(self.command_ids)
        deadline = None if work_s is None else time.monotonic() + work_s
        sent = []
        for rank, conn in enumerate(self.conns):
            command = Command(number, request[rank] if isinstance(request, list) else request, deadline)
            conn.send(command)
            self.unanswered[rank] = Unanswered(command, time.monotonic())
            sent.append(command)
        return sent

    def _reply(self, rank: int, command: Command, deadline: float) -> Reply:
        """Rank ``rank``'s reply to ``command``; any other reply that comes first is dropped, and logged."""
        while True:
            reply = self._recv(rank, self.conns[rank], deadline - time.monotonic(), command.name)
            if reply.id == command.id:
                self.unanswered[rank] = None
                return reply
            log(f"engine rank {rank}: dropped a reply to command {reply.id} while waiting for {command.name} "
                f"(command {command.id})")

    def _give_up(self) -> None:
        """The server waits no longer for the commands still unanswered (the lock holder's call ended)."""
        now = time.monotonic()
        for rank, u in enumerate(self.unanswered):
            if u is not None and u.given_up is None:
                self.unanswered[rank] = Unanswered(u.command, u.sent, now)
                log(f"engine rank {rank} has not answered {u.command.name} (command {u.command.id}) within "
                    f"{now - u.sent:.0f} s: it takes no command until it does")

    def _drop_late_replies(self) -> None:
        """Read, log and drop the replies that came to commands the server gave up on (holding the lock)."""
        for rank, u in enumerate(self.unanswered):
            conn = self.conns[rank]
            while u is not None and self.procs[rank].is_alive() and conn.poll(0):
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    break
                number = reply.id if isinstance(reply, Reply) else None
                if number != u.command.id:
                    log(f"engine rank {rank}: dropped a reply to command {number}, not the one it owes "
                        f"({u.command.name}, command {u.command.id})")
                    continue
                log(f"engine rank {rank} answered {u.command.name} (command {u.command.id}) "
                    f"{time.monotonic() - u.sent:.0f} s after it was sent, past its bound: the reply was dropped")
                self.unanswered[rank] = u = None

    def drop_late_replies(self) -> None:
        """:meth:`_drop_late_replies` unless a command is in flight (then its caller will)."""
        if self.lock.acquire(blocking=False):
            try:
                self._drop_late_replies()
            finally:
                self.lock.release()

    def unanswered_problem(self) -> str | None:
        """Why the engine takes no command now (None: it takes them): ranks that have not answered a command the
        server gave up on."""
        late = [(rank, u, u.given_up) for rank, u in enumerate(self.unanswered)
                if u is not None and u.given_up is not None]
        if not late:
            return None
        _, first, given_up = late[0]
        return (f"engine ranks {[rank for rank, _, _ in late]} have not answered {first.command.name} (command "
                f"{first.command.id}), sent {time.monotonic() - first.sent:.0f} s ago and given up on after "
                f"{given_up - first.sent:.0f} s (its bound): the engine takes no command until they answer; "
                "restart it if they never do")

    def health_problem(self) -> str | None:
        """Why the engine cannot serve (None: it can): a worker not running, or one that has not answered."""
        self.drop_late_replies()
        dead = [f"rank {rank} (exit code {p.exitcode})" for rank, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            return f"engine workers not running: {', '.join(dead)}"
        return self.unanswered_problem()

    # -- update sessions: committed whole, or rolled back to the last committed weights -----------

    def check_settled(self) -> None:
        """Raise :class:`UpdateInFlight` while an open session has started loading: the weights may be part
        old, part new (with rollback on, the committed ones come back if the session is aborted)."""
        if self.session_open and self.session_touched:
            raise UpdateInFlight(
                f"a weight update is being loaded ({self.session_loaded} tensors so far): the weights are not "
                f"served until it is committed or aborted (committed version: {self.weight_version})")

    def begin_session(self, timeout_s: float | None, workers: bool = True) -> None:
        """``workers`` False: the workers open theirs with the update's own command (``ipc_session``)."""
        problem = duration_problem("timeout_s", timeout_s)  # the watchdog must be able to end the session
        if problem is not None:
            raise EngineFailure(problem)
        with self.session_lock:
            if self.session_open:
                raise EngineFailure("a weight update session is already open")
            if workers:
                self.call(BeginSession())
            self.session_open, self.session_failed, self.session_loaded, self.pending_version = True, None, 0, None
            self.session_touched = False
            self.session_delta = self.session_plain = False
            self.session_timeout_s = float(timeout_s) if timeout_s else self.command_timeout_s
            self.last_activity = time.monotonic()

    def prepare_session(self) -> str:
        """The first phase of a commit across several engines (the trainer commits none of them until every one
        has prepared): whatever the commit could still fail on happens now, and the session stays open and
        restorable (an abort puts the last committed weights back). Returns the version a commit will serve."""
        with self.session_lock:
            self._check_committable()
            self.call(PrepareSession())
            self.last_activity = time.monotonic()
            return self.pending_version if self.pending_version is not None else self.weight_version

    def _check_committable(self) -> None:
        """A session can be prepared or committed: it is open and nothing in it failed (one that failed is
        aborted here, and the failure raised)."""
        if not self.session_open:
            raise EngineFailure("no weight update session is open")
        if self.session_failed:
            failed = self.session_failed
            self._abort_locked()
            raise EngineFailure(f"the session failed and was not committed: {failed}; {self.after_abort()}")

    def commit_session(self, workers: bool = True) -> str:
        """``workers`` False: the workers committed theirs at the end of the update's own command (``ipc_session``
        at TP 1, where one rank's commit is the engine's)."""
        with self.session_lock:
            self._check_committable()
            if workers:
                self.call(CommitSession())
            self.session_open = False
            self.weights_released = False
            if self.pending_version is not None:
                self.weight_version = self.pending_version
            self._settle_delta()
            return f"committed {self.session_loaded} tensors; weight_version {self.weight_version}"

    def _settle_delta(self) -> None:
        """At a commit: a session of delta buckets only leaves the workers holding its version's bytes; one that
        loaded other buckets leaves them behind the weights (dropped)."""
        if self.session_plain:
            if self.delta_version is not None or self.session_delta:
                self.call(ForgetDelta())
            self.delta_version = None
        elif self.session_delta:
            self.delta_version = self.weight_version

    @property
    def delta_base(self) -> str | None:
        return None if self.delta_version is None else f"{self.instance}/{self.delta_version}"

    def abort_session(self, why: str) -> str:
        with self.session_lock:
            if not self.session_open:
                return "no weight update session was open"
            self._abort_locked()
            log(f"update session aborted ({why}); {self.after_abort()}")
            return f"aborted; {self.after_abort()}"

    def after_abort(self) -> str:
        if self.rollback:
            return f"the last committed weights (version {self.weight_version}) are back in place"
        return ("this engine keeps no backup (rollback off): what the session loaded is stale, and the engine "
                "serves again after a complete update")

    def _abort_locked(self) -> None:
        self.drop_late_replies()
        if (problem := self.unanswered_problem()) is not None:  # the session stays open: aborted once they answer
            raise EngineUnavailable(problem)
        self.session_open = False
        if self.session_delta:  # the workers drop the bytes the session changed
            self.delta_version = None
        self.call(AbortSession())

    def watch_sessions(self) -> None:
        """A session whose trainer went quiet for longer than the bound it gave is given up: the last
        committed weights are put back, the groups torn down and generation resumed."""
        while not self.stopping:
            # Woken at the session's deadline, not on a coarse tick: the rollback starts 1 s before the
            # documented bound (T + 2 s after the trainer's last word) and has that second to finish.
            due = self.last_activity + self.session_timeout_s + SESSION_GRACE_S - time.monotonic()
            time.sleep(min(0.25, max(0.01, due)) if self.session_open else 0.25)
            self.drop_late_replies()  # a late reply is dropped (and the engine healthy again) as it comes
            if not self.session_open or self.busy or self.unanswered_problem() is not None:
                continue
            idle = time.monotonic() - self.last_activity
            if idle >= self.session_timeout_s + SESSION_GRACE_S:
                try:
                    self.abort_session(f"no word from the trainer for {idle:.0f} s")
                    self.call(DestroyAllGroups(), wait_s=10.0)
                except EngineFailure as exc:
                    log(f"could not abort the idle session: {exc}")
                self.paused.clear()

    def gpu_uuids(self) -> list[str]:
        if self.backend != "nccl":
            return []
        return [gpu_uuid(torch.device(d)) for d in self.devices]

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Stop the workers: each asked to exit, and given ``grace_s`` to. A worker that owes an answer to a
        command is busy with it (stuck in a transfer, or in a forward pass) and reads no request until it is
        done: it is killed at once, as is any worker still running after the grace. An update in flight is not
        committed."""
        self.stopping = True
        busy = [rank for rank, u in enumerate(self.unanswered) if u is not None]
        for rank, conn in enumerate(self.conns):
            try:
                if self.procs[rank].is_alive() and rank not in busy:
                    conn.send(Command(next(self.command_ids), Shutdown()))
            except (BrokenPipeError, OSError):
                pass
        for rank in busy:
            self.procs[rank].kill()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for conn in self.conns:
            conn.close()


def _results(replies: list[Reply]) -> list[Any]:
    """What every rank's command returned; else one error naming each failing rank (:class:`WorkOutOfTime` where
    the work stopped at its deadline)."""
    out_of_time = [r.result for r in replies if r.outcome is Outcome.OUT_OF_TIME]
    if out_of_time:
        raise WorkOutOfTime(out_of_time[0])
    failed = [f"rank {rank}: {r.result}" for rank, r in enumerate(replies) if r.outcome is not Outcome.DONE]
    if failed:
        raise EngineFailure(" | ".join(failed))
    return [r.result for r in replies]
