"""The embedded reference engine: an HTTP server speaking SGLang's weight-update protocol.

``weightstream engine --model DIR --tp N`` starts N worker processes (one per engine TP rank, each
holding its shard) and serves, on loopback by default:

- SGLang's protocol: ``/init_weights_update_group``, ``/update_weights_from_distributed``
  (per tensor or ``flattened_bucket``), ``/update_weights_from_tensor``, ``/destroy_weights_update_group``,
  ``/pause_generation``, ``/continue_generation``, ``/begin_weight_update``, ``/end_weight_update``,
  ``/update_weight_version``, ``/flush_cache``, ``/generate``, ``/model_info``, ``/get_server_info``, ``/health``;
- weightstream's additions: ``/weightstream/update_weights_from_p2p`` (per-rank buckets by send/recv, or a
  resharded bucket's pieces from several trainer ranks), ``/weightstream/layout`` (how it splits each tensor,
  and which rank holds each expert under expert parallelism), ``/weightstream/weight_checksums`` (per rank, of
  the bytes it holds of the tensors named),
  the ``*_ahead`` routes (every bucket's metadata in one request), ``/weightstream/logits``,
  ``/weightstream/prepare_weight_update`` (a commit's first phase, where a trainer commits several engines all
  or none) and ``/weightstream/abort_weight_update``, and two fields:
  ``pause`` in ``/begin_weight_update`` and ``resume`` in ``/end_weight_update`` (one request each instead
  of two).

Every reply to a weight-update call is ``{"success": bool, "message": str}`` (HTTP 200 or 400); the
optional bearer token is checked on every route but ``/health``.
"""

from __future__ import annotations

import base64
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
from http import HTTPStatus
from typing import Any

import torch

from weightstream.common.http_server import BadRequest, HttpLimits, JsonHttpServer
from weightstream.common.processes import free_port, process_context, start_process
from weightstream.engines.reference import ENGINE_NAME
from weightstream.receiver.requests import (
    BROADCAST_AHEAD_ROUTE,
    BROADCAST_ROUTE,
    P2P_AHEAD_ROUTE,
    P2P_ROUTE,
    PREPARE_IPC_ROUTE,
    TENSOR_ROUTE,
    UPDATE_SCHEMAS,
    UPDATES,
    BeginRequest,
    CommitRequest,
    DestroyGroupRequest,
    EmptyRequest,
    InitGroupRequest,
    IpcUpdate,
    PauseRequest,
    RankReceives,
    ReleaseIpcRequest,
    RequestError,
    Schema,
    UpdateRequest,
    VersionRequest,
    WeightChecksumsRequest,
    decode_update,
)
from weightstream.receiver.schema import duration_problem, ep_problem
from weightstream.receiver.values import DEFAULT_CHECKS, LoadChecks
from weightstream.reference_engine.protocol import (
    START_ID,
    AbortSession,
    BeginSession,
    Command,
    CommitSession,
    DeltaChecksums,
    DestroyAllGroups,
    DestroyGroup,
    ForgetDelta,
    Generate,
    GenerateRequest,
    InitGroup,
    Layout,
    Logits,
    LogitsRequest,
    Memory,
    Outcome,
    PrepareSession,
    ReleaseIpc,
    ReleaseMemory,
    ReleaseMemoryRequest,
    Reply,
    ResumeMemory,
    ResumeMemoryRequest,
    Shutdown,
    UpdatePhases,
    WeightChecksums,
    name_of,
)
from weightstream.reference_engine.worker import worker_main
from weightstream.wire.handles import gpu_uuid

__all__ = [
    "BULK_ROUTES", "ServerLimits", "log", "SESSION_GRACE_S", "EngineFailure", "UpdateInFlight", "EngineUnavailable",
    "WorkOutOfTime", "Unanswered", "REQUESTS", "SCHEMAS", "decode_body", "gloo_interface", "Engine", "EngineServer",
    "serve", "stop"
]


# Routes whose bodies carry weights or the metadata of every bucket: these may be up to ``max_body_bytes``;
# every other route's body is small (``max_small_body_bytes``).
BULK_ROUTES = frozenset({BROADCAST_ROUTE, BROADCAST_AHEAD_ROUTE, TENSOR_ROUTE, P2P_ROUTE, P2P_AHEAD_ROUTE})


@dataclass(frozen=True, slots=True)
class ServerLimits(HttpLimits):
    """What one client may hold of the engine's HTTP server (:class:`HttpLimits`), or ask of the engine in one
    request (docs/engines.md, "Bounds")."""

    max_batch_tokens: int = 16384  # /generate and /weightstream/logits: the sum over rows of prompt + new tokens
    max_request_s: float = 60.0  # the workers' time for one /generate request, checked between decode steps

    def problems(self) -> list[str]:
        problems = HttpLimits.problems(self)
        if not 0 < self.max_request_s < float("inf"):
            problems.append(f"max_request_s must be a positive number of seconds, got {self.max_request_s!r}")
        if not self.max_batch_tokens > 0:
            problems.append(f"max_batch_tokens must be a positive integer, got {self.max_batch_tokens!r}")
        return problems


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


# The typed request each route other than the updates decodes its body into; a route not named here and not an
# update reads no field (:class:`EmptyRequest`).
_TYPED: tuple[Any, ...] = (
    InitGroupRequest, DestroyGroupRequest, BeginRequest, CommitRequest, PauseRequest, VersionRequest,
    WeightChecksumsRequest, ReleaseIpcRequest, ReleaseMemoryRequest, ResumeMemoryRequest, GenerateRequest,
    LogitsRequest)
REQUESTS: dict[str, Callable[[dict], Any]] = {r.ROUTE: r.decode for r in _TYPED}

# Every route's body schema (the update routes' and the typed requests').
SCHEMAS: dict[str, Schema] = {**UPDATE_SCHEMAS, **{r.ROUTE: r.FIELDS for r in _TYPED}}


def decode_body(path: str, body: dict) -> Any:
    """What a route runs on: its typed request (an update's: :func:`decode_update`; any other's: :data:`REQUESTS`);
    a body refused is one :class:`BadRequest` (400) listing every problem."""
    try:
        if path in UPDATES:
            return decode_update(path, body)
        return REQUESTS.get(path, EmptyRequest.decode)(body)
    except RequestError as exc:
        raise BadRequest(HTTPStatus.BAD_REQUEST, exc.message) from None


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

    def begin_session(self, timeout_s: float | None) -> None:
        problem = duration_problem("timeout_s", timeout_s)  # the watchdog must be able to end the session
        if problem is not None:
            raise EngineFailure(problem)
        with self.session_lock:
            if self.session_open:
                raise EngineFailure("a weight update session is already open")
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

    def commit_session(self) -> str:
        with self.session_lock:
            self._check_committable()
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
        """Stop the workers: asked to exit, then killed if they are still busy (a worker stuck in a
        transfer cannot listen) after ``grace_s``. An update in flight is not committed."""
        self.stopping = True
        for rank, conn in enumerate(self.conns):
            try:
                if self.procs[rank].is_alive():
                    conn.send(Command(next(self.command_ids), Shutdown()))
            except (BrokenPipeError, OSError):
                pass
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


# The status a route's engine error answers, the first kind it is of.
_FAILURES: tuple[tuple[type[Exception], HTTPStatus], ...] = (
    (UpdateInFlight, HTTPStatus.CONFLICT), (EngineUnavailable, HTTPStatus.SERVICE_UNAVAILABLE),
    (EngineFailure, HTTPStatus.BAD_REQUEST))


class EngineServer(JsonHttpServer):
    """The engine's HTTP face (:class:`JsonHttpServer`): SGLang's routes and weightstream's, each run on the typed
    request its body decodes into (:func:`decode_body`)."""

    limits: ServerLimits

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 limits: ServerLimits = ServerLimits()):
        super().__init__((host, port), limits, api_key, bulk_routes=BULK_ROUTES)
        self.engine = engine
        if not api_key:
            log(f"WARNING: no API key: any process that can reach {self.url} can load weights into this engine, "
                "pause it and free its memory (set WEIGHTSTREAM_API_KEY or --api-key-file)")
        e = engine
        self.routes.update({("POST", route): self.update for route in UPDATES if route != PREPARE_IPC_ROUTE})
        self.routes.update({
            ("GET", "/health"): self.health,
            ("GET", "/model_info"): lambda b: (200, {"model_path": e.model_dir, "weight_version": e.weight_version,
                                                     "is_generation": True}),
            ("GET", "/get_server_info"): self.server_info,
            ("POST", "/init_weights_update_group"): self.init_group,
            ("POST", "/destroy_weights_update_group"): self.destroy_group,
            ("POST", "/weightstream/release_ipc_buffers"): self.release_ipc,
            ("POST", PREPARE_IPC_ROUTE): self.prepare_ipc_ahead,
            ("POST", "/begin_weight_update"): self.begin,
            ("POST", "/end_weight_update"): self.end,
            ("POST", "/weightstream/prepare_weight_update"): self.prepare_commit,
            ("POST", "/weightstream/abort_weight_update"): self.abort,
            ("POST", "/pause_generation"): self.pause,
            ("POST", "/continue_generation"): self.resume,
            ("POST", "/update_weight_version"): self.update_version,
            ("POST", "/flush_cache"): self.flush_cache,
            ("GET", "/flush_cache"): self.flush_cache,
            ("POST", "/generate"): self.generate,
            ("POST", "/weightstream/logits"): self.logits,
            ("POST", "/release_memory_occupation"): self.release_memory,
            ("POST", "/resume_memory_occupation"): self.resume_memory,
            ("GET", "/weightstream/memory"): lambda b: (200, {"ranks": self.engine.call(Memory())}),
            ("GET", "/weightstream/delta_checksums"): self.delta_checksums,
            ("GET", "/weightstream/update_phases"): self.update_phases,
            ("GET", "/weightstream/layout"): self.layout,
            ("POST", "/weightstream/weight_checksums"): self.weight_checksums,
        })

    def decode(self, path: str, body: dict) -> Any:
        return decode_body(path, body)

    def failure(self, exc: Exception) -> tuple[int, Any]:
        """An engine error answers ``success: false`` (409 while an update is in flight, 503 while a worker owes an
        answer, else 400); a value the route could not take, 400 naming it."""
        for kind, status in _FAILURES:
            if isinstance(exc, kind):
                return status, {"success": False, "message": str(exc)}
        if isinstance(exc, (KeyError, TypeError, ValueError)):
            return HTTPStatus.BAD_REQUEST, {"object": "error", "message": f"bad request: {exc!r}", "code": 400}
        return super().failure(exc)

    def stopping(self) -> bool:
        return self.engine.stopping

    def log(self, message: str) -> None:
        log(message)

    # -- routes -------------------------------------------------------------------------------

    def health(self, r: EmptyRequest):
        """200 while every worker runs and answers; else 503 saying why (:meth:`Engine.health_problem`)."""
        problem = self.engine.health_problem()
        if problem is None:
            return 200, {}
        return HTTPStatus.SERVICE_UNAVAILABLE, {"status": "unhealthy", "message": problem}

    def server_info(self, r: EmptyRequest):
        e = self.engine
        return 200, {
            "engine": ENGINE_NAME, "tp_size": e.tp, "ep_size": e.ep, "pp_size": 1, "dp_size": 1,
            "model_path": e.model_dir,
            "weight_version": e.weight_version, "device": e.devices[0].split(":")[0], "gpu_uuids": e.gpu_uuids(),
            "hostname": socket.gethostname(), "pid": os.getpid(), "dtype": e.dtype,
            "quantization_config": e.quantization_config, "refuse_nonfinite": e.checks.refuse_nonfinite,
            "capabilities": ["broadcast", "ipc", "ipc_ahead", "p2p", "reshard", "release_memory"]
            + (["rollback"] if e.rollback else [])
            + ["broadcast_ahead", "p2p_ahead", "delta", "delta_ahead", "warm_group"],
            "instance": e.instance, "delta_base": e.delta_base,
            "update_session_open": e.session_open,
            "update_session_loaded": e.session_loaded,  # tensors loaded in the open session so far
            "worker_pids": [p.pid for p in e.procs],
        }

    def init_group(self, r: InitGroupRequest):
        msgs = self.engine.call(InitGroup(  # timeout_s: the trainer's bound: the workers give up at it
            master_address=r.master_address, master_port=r.master_port, rank_offset=r.rank_offset,
            world_size=r.world_size, group_name=r.group_name, backend=r.backend, timeout_s=r.timeout_s,
            warm=r.warm, warm_senders=r.warm_senders,
        ), wait_s=r.timeout_s + 5.0)
        return 200, {"success": True, "message": " | ".join(msgs)}

    def destroy_group(self, r: DestroyGroupRequest):
        self.engine.call(DestroyGroup(r.group_name))
        return 200, {"success": True, "message": "destroyed"}

    def _receives(self, r: UpdateRequest) -> RankReceives:
        """Each rank's receive of update ``r`` (refused, 400, where ``r`` does not fit this engine's ranks)."""
        try:
            return r.receives(self.engine.tp, self.engine.session_timeout_s)
        except RequestError as exc:
            raise BadRequest(HTTPStatus.BAD_REQUEST, exc.message) from None

    def update(self, r: UpdateRequest):
        """One update request of the open session (every update route); a failure marks the session failed (the
        update is then not complete). From the first on, the weights are not served until the session ends
        (:meth:`Engine.check_settled`)."""
        e = self.engine
        if not e.session_open:
            raise EngineFailure(f"{r.route.rsplit('/', 1)[1]} must run between begin_weight_update() and "
                                "end_weight_update()")
        receives = self._receives(r)
        e.session_touched = True
        if r.delta:
            e.session_delta = True
        else:
            e.session_plain = True
        try:
            results = e.call(list(receives.per_rank), wait_s=receives.wait_s)
        except EngineFailure as exc:
            e.session_failed = str(exc)
            raise EngineFailure(f"Failed to update weights: {exc}. This session will not be committed: "
                                f"ending or aborting it: {e.after_abort()}.") from None
        return 200, {"success": True, "message": self._loaded(results, r.weight_version)}

    def _loaded(self, results: list[Any], version: str | None) -> str:
        """What an update's ranks loaded, counted into the session; ``version``: what the commit will serve."""
        loaded = int(results[0]["loaded"]) if results and isinstance(results[0], dict) else 0
        self.engine.session_loaded += loaded
        msg = f"Succeeded to update weights ({loaded} tensors)."
        nonfinite = sorted({n for r in results if isinstance(r, dict) for n in r.get("nonfinite", ())})
        if nonfinite:  # loaded as they are (an engine started with --refuse-nonfinite refuses them)
            msg += f" NaN or an infinity in {len(nonfinite)} tensors of this session: {', '.join(nonfinite[:8])}"
        if version is not None:
            self.engine.pending_version = version
        return msg

    def delta_checksums(self, r: EmptyRequest):
        """What the open (or last) session's delta buckets left in each worker: the checksum of each bucket's
        bytes, per engine rank, by bucket index; and what this engine holds (``delta_base``)."""
        e = self.engine
        ranks = e.call(DeltaChecksums())
        indices = sorted({i for r in ranks for i in r})
        return 200, {"instance": e.instance, "delta_base": e.delta_base,
                     "buckets": {str(i): [r.get(i) for r in ranks] for i in indices}}

    def update_phases(self, r: EmptyRequest):
        """Where the last update session's time went on each engine rank: seconds per phase (the worker's
        ``update_phases``), rank by rank."""
        return 200, {"ranks": self.engine.call(UpdatePhases())}

    def prepare_ipc_ahead(self, r: IpcUpdate):
        """Outside any session: the workers learn a trainer's plan and map its kept buffers."""
        receives = self._receives(r)
        held = self.engine.call(list(receives.per_rank), wait_s=receives.wait_s)
        return 200, {"success": True, "message": f"prepared; IPC buffers held per rank: {[h['held'] for h in held]}"}

    def release_ipc(self, r: ReleaseIpcRequest):
        released = sum(rank["released"] for rank in self.engine.call(ReleaseIpc(r.client)))
        return 200, {"success": True, "message": f"closed {released} IPC buffers of this client"}

    def layout(self, r: EmptyRequest):
        """How the engine holds the checkpoint's tensors over its ranks (weightstream's resharding reads it): the dim
        each split tensor is split on, and the rank that holds each tensor one rank holds alone (experts under EP)."""
        declared = self.engine.call(Layout())[0]
        return 200, {"tp_size": self.engine.tp, "ep_size": self.engine.ep, "dims": declared["dims"],
                     "owners": declared["owners"]}

    def weight_checksums(self, r: WeightChecksumsRequest):
        """Per rank, the checksum of the bytes it holds of each of ``names`` (those it holds; its part of a split
        tensor): what a check of an update compares with the trainer's tensors."""
        return 200, {"ranks": self.engine.call(WeightChecksums(list(r.names)), committed=True)}

    def begin(self, r: BeginRequest):
        """``pause`` (a mode): pause generation first, as ``/pause_generation`` does (one request for both)."""
        if r.pause:
            self.pause(PauseRequest(r.pause))
        self.engine.begin_session(r.timeout_s)
        if r.weight_version is not None:  # what the commit will serve, unless a bucket says otherwise
            self.engine.pending_version = r.weight_version
        return 200, {"success": True, "message": "weight update session opened"}

    def end(self, r: CommitRequest):
        """``resume``: generation continues once the session is committed (one request for both)."""
        message = self.engine.commit_session()  # the engine has no cache of its own to flush
        if r.resume:
            self.resume(EmptyRequest())
        return 200, {"success": True, "message": message, "weight_version": self.engine.weight_version}

    def prepare_commit(self, r: EmptyRequest):
        """The first phase of a commit across engines (:meth:`Engine.prepare_session`): the version the commit
        will serve."""
        version = self.engine.prepare_session()
        return 200, {"success": True, "message": "prepared to commit; still restorable", "weight_version": version}

    def abort(self, r: EmptyRequest):
        return 200, {"success": True, "message": self.engine.abort_session("asked by the trainer")}

    def pause(self, r: PauseRequest):
        self.engine.paused.set()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, r: EmptyRequest):
        if self.engine.session_open:  # generation continues when the session is committed or aborted
            raise UpdateInFlight("a weight update session is open: generation continues once it is committed "
                                 "(/end_weight_update with resume) or aborted")
        self.engine.paused.clear()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def release_memory(self, r: ReleaseMemoryRequest):
        if self.engine.session_open:
            raise EngineFailure("cannot release memory during a weight update session")
        ranks = self.engine.call(ReleaseMemory(r.tags))
        if "weights" in r.tags:
            self.engine.weights_released = True
        return 200, {"success": True, "message": f"released {sum(r['freed_bytes'] for r in ranks)} bytes",
                     "ranks": ranks}

    def resume_memory(self, r: ResumeMemoryRequest):
        ranks = self.engine.call(ResumeMemory(r.tags))
        return 200, {"success": True, "message": f"re-created {sum(r['restored_bytes'] for r in ranks)} bytes",
                     "ranks": ranks}

    def flush_cache(self, r: EmptyRequest):
        return 200, "Cache flushed.\n"  # the engine has no cache of its own; text, as SGLang answers

    def update_version(self, r: VersionRequest):
        self.engine.weight_version = r.new_version
        return 200, {"success": True, "message": f"Weight version updated to {r.new_version}",
                     "new_version": self.engine.weight_version}

    def _wait_unpaused(self) -> None:
        if self.engine.weights_released:
            raise BadRequest(HTTPStatus.CONFLICT,
                             "the weights were released: resume them and update them before generating")
        deadline = time.monotonic() + self.engine.command_timeout_s
        while self.engine.paused.is_set():
            if time.monotonic() > deadline:
                raise EngineFailure("generation stayed paused past the request's time limit")
            time.sleep(0.05)

    def _check_work(self, rows: list[list[int]], new_tokens: int) -> None:
        """What one request may ask of the model: 413 past the bounds (each row's tokens, new ones included,
        within the model's ``max_position_embeddings``; all rows' within ``max_batch_tokens``), then 400 for
        token ids outside the vocabulary."""
        too_much = []
        total = sum(len(row) for row in rows) + new_tokens * len(rows)
        if total > self.limits.max_batch_tokens:
            too_much.append(f"{len(rows)} rows of {total} tokens in all (prompt + max_new_tokens) exceed this "
                            f"engine's max_batch_tokens ({self.limits.max_batch_tokens})")
        limit = self.engine.max_positions
        long = [i for i, row in enumerate(rows) if limit is not None and len(row) + new_tokens > limit]
        if long:
            too_much.append(f"rows {long[:5]} have more tokens (prompt + max_new_tokens) than the model's "
                            f"max_position_embeddings ({limit})")
        if too_much:
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "; ".join(too_much))
        vocab = self.engine.vocab_size
        out_of_range = sorted({t for row in rows for t in row if t >= vocab})
        if out_of_range:
            raise BadRequest(HTTPStatus.BAD_REQUEST,
                             f"token ids {out_of_range[:5]} are outside the vocabulary (size {vocab})")

    def generate(self, r: GenerateRequest):
        batch, n = [list(row) for row in r.rows], r.max_new_tokens
        self._check_work(batch, n)
        self.engine.check_settled()
        self._wait_unpaused()
        outs = []
        for seq, out in zip(batch, self._generated(batch, n), strict=True):
            outs.append({"text": "", "output_ids": out, "meta_info": {
                "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(seq),
                "completion_tokens": len(out), "weight_version": self.engine.weight_version}})
        return 200, outs[0] if r.one_row else outs

    def _generated(self, rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Each row's new tokens, the rows run by one command, stopped by the workers past ``max_request_s``
        (413, naming the bound)."""
        limit = self.limits.max_request_s
        try:
            return self.engine.call(Generate(rows, new_tokens), committed=True, work_s=limit,
                                    wait_s=self.engine.command_timeout_s + limit)[0]
        except WorkOutOfTime as exc:
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, (
                f"/generate ran past {limit:g} s, this engine's bound on the time one request may take "
                f"(max_request_s; weightstream engine --max-request-seconds), and was stopped ({exc}): "
                "ask for fewer rows or fewer new tokens")) from None

    def logits(self, r: LogitsRequest):
        rows = [list(row) for row in r.rows]  # of one length (LogitsRequest.decode)
        self._check_work(rows, 0)
        self.engine.check_settled()
        self._wait_unpaused()
        out = self.engine.call(Logits(rows), committed=True)[0]
        return 200, {"shape": list(out.shape), "dtype": "float32",
                     "logits_b64": base64.b64encode(out.tobytes()).decode(),
                     "weight_version": self.engine.weight_version}


def serve(model_dir: str, tp: int = 1, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
          device: str | None = None, dtype: str = "float32", rollback: bool = True,
          limits: ServerLimits = ServerLimits(), worker: Callable[..., None] = worker_main,
          ep: int = 1, checks: LoadChecks = DEFAULT_CHECKS) -> EngineServer:
    """Start an engine and its HTTP server (serving in a background thread); returns the server.
    ``rollback=False``: no copy of the weights is kept during an update (as SGLang keeps none); an aborted
    update then leaves the engine refusing to serve until a complete update has loaded every tensor.
    ``limits``: what one client may hold or ask (:class:`ServerLimits`). ``worker``: each worker process's
    entry (:class:`Engine`). ``ep``: expert parallelism over the TP group (:class:`Engine`). ``checks``: what the values
    of an update are checked for (:class:`Engine`)."""
    engine = Engine(model_dir, tp, device=device, dtype=dtype, rollback=rollback, host=host, worker=worker, ep=ep,
                    checks=checks)
    try:
        server = EngineServer(engine, host, port, api_key, limits)
    except BaseException:
        engine.shutdown()
        raise
    threading.Thread(target=server.serve_forever, name="weightstream-engine-http", daemon=True).start()
    threading.Thread(target=engine.watch_sessions, name="weightstream-engine-sessions", daemon=True).start()
    return server


def stop(server: EngineServer) -> None:
    server.shutdown()
    server.server_close()
    server.engine.shutdown()
