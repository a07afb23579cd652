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
import hmac
import io
import ipaddress
import itertools
import json
import os
import re
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from weightstream.common.processes import free_port, process_context, start_process
from weightstream.engines.reference import ENGINE_NAME
from weightstream.receiver.plan import (
    DenseBucket,
    IpcReceive,
    RankBucket,
    Receive,
    ReceivePlan,
    TensorReceive,
    Transport,
)
from weightstream.receiver.requests import (
    DURATION_FIELDS,
    INT_RANGES,
    TEXT_FIELDS,
    UPDATE_SCHEMAS,
    BeginRequest,
    CommitRequest,
    DestroyGroupRequest,
    EmptyRequest,
    InitGroupRequest,
    PauseRequest,
    ReleaseIpcRequest,
    RequestError,
    Schema,
    VersionRequest,
    WeightChecksumsRequest,
    update_problems,
)
from weightstream.receiver.schema import (
    MAX_JSON_DEPTH,
    delta_problems,
    duration_problem,
    ep_problem,
    nesting_exceeds,
)
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
    "MAX_BODY_BYTES", "BULK_ROUTES", "ServerLimits", "log", "SESSION_GRACE_S", "EngineFailure", "UpdateInFlight",
    "EngineUnavailable", "WorkOutOfTime", "Unanswered", "BadRequest", "SCHEMAS", "DURATION_FIELDS", "INT_RANGES",
    "TEXT_FIELDS", "REQUESTS", "check_body", "decode_body", "gloo_interface", "Engine", "bearer_matches",
    "announces_body", "read_chunked", "parse_body", "RequestReadTimeout", "BoundedReads", "raw_reply", "EngineServer",
    "serve", "stop"
]


MAX_BODY_BYTES = 64 << 20
# Routes whose bodies carry weights or the metadata of every bucket: these may be up to ``max_body_bytes``;
# every other route's body is small (``max_small_body_bytes``).
BULK_ROUTES = frozenset({
    "/update_weights_from_distributed", "/weightstream/update_weights_from_distributed_ahead",
    "/update_weights_from_tensor", "/weightstream/update_weights_from_p2p",
    "/weightstream/update_weights_from_p2p_ahead",
})


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one client may hold of the HTTP server, or ask of the engine in one request (docs/engines.md,
    "Bounds")."""

    max_body_bytes: int = MAX_BODY_BYTES  # a body of a route in BULK_ROUTES
    max_small_body_bytes: int = 1 << 20  # a body of any other route
    max_connections: int = 512  # open at once; more go to the reserve (below), past it answered 503 and closed
    idle_timeout_s: float = 30.0  # a client that sends nothing (or stops mid-request) this long is disconnected
    listen_backlog: int = 1024  # connections the kernel queues until the server accepts them (bursts)
    max_batch_tokens: int = 16384  # /generate and /weightstream/logits: the sum over rows of prompt + new tokens
    max_request_s: float = 60.0  # the workers' time for one /generate request, checked between decode steps
    request_read_s: float = 60.0  # one request's line, headers and body must all arrive within this
    reserve_connections: int = 16  # past max_connections, read for GET /health only (others: 503)
    reserve_read_s: float = 2.0  # the whole-request bound on those

    def __post_init__(self) -> None:
        problems = [f"{name} must be a positive number of seconds, got {value!r}" for name, value in (
            ("idle_timeout_s", self.idle_timeout_s), ("max_request_s", self.max_request_s),
            ("request_read_s", self.request_read_s), ("reserve_read_s", self.reserve_read_s))
            if not 0 < value < float("inf")]
        problems += [f"{name} must be a positive integer, got {value!r}" for name, value in (
            ("max_body_bytes", self.max_body_bytes), ("max_small_body_bytes", self.max_small_body_bytes),
            ("max_connections", self.max_connections), ("listen_backlog", self.listen_backlog),
            ("max_batch_tokens", self.max_batch_tokens)) if not value > 0]
        if self.reserve_connections < 0:
            problems.append(f"reserve_connections must be 0 or more, got {self.reserve_connections!r}")
        if problems:
            raise ValueError("bad server limits: " + "; ".join(problems))


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


class BadRequest(Exception):
    """A request the engine refuses as it stands (4xx), before anything runs."""

    def __init__(self, status: int, message: str):
        self.status, self.message = HTTPStatus(status), message
        super().__init__(message)


# The typed request each route other than the updates decodes its body into; a route not named here and not an
# update reads no field (:class:`EmptyRequest`).
_TYPED: tuple[Any, ...] = (
    InitGroupRequest, DestroyGroupRequest, BeginRequest, CommitRequest, PauseRequest, VersionRequest,
    WeightChecksumsRequest, ReleaseIpcRequest, ReleaseMemoryRequest, ResumeMemoryRequest, GenerateRequest,
    LogitsRequest)
REQUESTS: dict[str, Callable[[dict], Any]] = {r.ROUTE: r.decode for r in _TYPED}

# Every route's body schema (the update routes' and the typed requests').
SCHEMAS: dict[str, Schema] = {**UPDATE_SCHEMAS, **{r.ROUTE: r.FIELDS for r in _TYPED}}


def check_body(path: str, body: dict) -> None:
    """Raise one :class:`BadRequest` listing every problem of an update route's ``body`` for ``path``."""
    problems = update_problems(path, body)
    if problems:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"bad request to {path}: " + "; ".join(problems))


def decode_body(path: str, body: dict) -> Any:
    """What a route runs on: an update route's checked body (:func:`check_body`), any other route's typed request
    (:data:`REQUESTS`); a body refused is one :class:`BadRequest` (400) listing every problem."""
    if path in UPDATE_SCHEMAS:
        check_body(path, body)
        return body
    try:
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


def bearer_matches(header: str, key: str) -> bool:
    """``Authorization: Bearer KEY``, the scheme in any case (RFC 9110), the key compared in constant time.
    (Header text arrives decoded as Latin-1: encoded back, it is the bytes the client sent.)"""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key.encode())


def announces_body(headers) -> bool:
    return headers.get("Transfer-Encoding") is not None or headers.get("Content-Length", "0").strip() not in ("", "0")


_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


def read_chunked(rfile: io.BufferedIOBase, limit: int) -> bytes:
    """A body sent with ``Transfer-Encoding: chunked`` (RFC 9112, 7.1), at most ``limit`` bytes; chunk
    extensions and trailer fields are read and dropped."""
    parts, total = [], 0
    while True:
        line = rfile.readline(4096)
        size_text = line.split(b";", 1)[0].strip()
        if not line.endswith(b"\n") or not _CHUNK_SIZE.fullmatch(size_text):
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"bad chunk size line {line[:40]!r}")
        size = int(size_text, 16)
        if size == 0:
            break
        total += size
        if total > limit:
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"chunked body of more than {limit} bytes exceeds the limit of {limit} bytes")
        data = rfile.read(size)
        if len(data) < size or rfile.readline(3) not in (b"\r\n", b"\n"):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "chunked body cut short (or a chunk not followed by CRLF)")
        parts.append(data)
    for _ in range(64):
        line = rfile.readline(4096)
        if line in (b"\r\n", b"\n"):
            return b"".join(parts)
        if not line.endswith(b"\n"):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "chunked body cut short in its trailer")
    raise BadRequest(HTTPStatus.BAD_REQUEST, "more than 64 trailer lines after a chunked body")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number this engine takes (finite numbers only)")


def parse_body(raw: bytes) -> dict:
    """A request's body: a JSON object of finite numbers, nested at most ``MAX_JSON_DEPTH`` levels."""
    deep = BadRequest(HTTPStatus.BAD_REQUEST, f"bad JSON: nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"bad JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"the body must be a JSON object, got {type(body).__name__}")
    if nesting_exceeds(body):
        raise deep
    return body


def _error(exc: BadRequest) -> dict:
    return {"object": "error", "success": False, "message": exc.message, "code": int(exc.status)}


class RequestReadTimeout(Exception):
    """One request's line, headers and body did not all arrive within its bound."""


class BoundedReads(io.RawIOBase):
    """A connection's reads: each waits at most ``idle_s`` for a byte and, once a request has begun (``deadline``
    set, a ``time.monotonic()``), none goes past the deadline (:class:`RequestReadTimeout`), however slowly the
    client trickles its bytes."""

    def __init__(self, sock: socket.socket, idle_s: float):
        super().__init__()
        self.sock, self.idle_s = sock, idle_s
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = None if self.deadline is None else self.deadline - time.monotonic()
        if left is not None and left <= 0:
            raise RequestReadTimeout
        self.sock.settimeout(self.idle_s if left is None else min(self.idle_s, left))
        try:
            return self.sock.recv_into(buffer)
        except TimeoutError:
            if left is not None and left <= self.idle_s:
                raise RequestReadTimeout from None
            raise
        finally:
            self.sock.settimeout(self.idle_s)  # what bounds the writes


def raw_reply(sock: socket.socket, status: HTTPStatus, message: str) -> None:
    """An answer written straight to the socket (no request parsed, or none to be read further), then the
    connection is to be closed."""
    body = json.dumps({"success": False, "code": int(status), "message": message}).encode()
    retry = "Retry-After: 1\r\n" if status == HTTPStatus.SERVICE_UNAVAILABLE else ""
    head = (f"HTTP/1.1 {int(status)} {status.phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{retry}\r\n").encode()
    try:
        sock.settimeout(1.0)
        sock.sendall(head + body)
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    """One connection of the ``max_connections``: requests one after another (keep-alive)."""

    server: EngineServer
    protocol_version = "HTTP/1.1"
    _unread = False  # the request announced a body that has not been read (whole) yet
    reserve = False  # a connection past max_connections (:class:`_ReserveHandler`)

    def setup(self) -> None:
        limits = self.server.limits
        # bounds every write on this connection; typeshed declares timeout a ClassVar, but
        # StreamRequestHandler.setup reads it from the instance, so a per-connection value is what it takes
        self.timeout = limits.reserve_read_s if self.reserve else limits.idle_timeout_s  # type: ignore[misc]
        super().setup()
        self.rfile.close()  # the socket's own reader: each read is bounded by the request's deadline instead
        self.reads = BoundedReads(self.connection, self.timeout)
        self.buffered = io.BufferedReader(self.reads)
        self.rfile = self.buffered

    def handle_one_request(self) -> None:
        """One request: the client may keep the connection idle ``idle_timeout_s`` before its first byte; from
        that byte on, its line, headers and body must all arrive within ``request_read_s`` (else 408, closed)."""
        limits = self.server.limits
        self.reads.deadline = None
        try:
            if not self.buffered.peek(1):  # the client closed the connection
                self.close_connection = True
                return
        except TimeoutError:
            self.close_connection = True
            if self.reserve:
                raw_reply(self.connection, HTTPStatus.SERVICE_UNAVAILABLE, self.server.busy_message())
            return
        bound = limits.reserve_read_s if self.reserve else limits.request_read_s
        self.reads.deadline = time.monotonic() + bound
        try:
            super().handle_one_request()
        except RequestReadTimeout:
            self.close_connection = True
            raw_reply(self.connection, HTTPStatus.REQUEST_TIMEOUT, (
                f"the request did not arrive whole within {bound:g} s (its line, headers and body; this "
                f"engine's {'reserve_read_s' if self.reserve else 'request_read_s'})"))

    def log_message(self, fmt, *args):  # quiet
        pass

    def _reply(self, status: int, body: Any) -> None:
        """``body``: text (sent as such, as SGLang answers /flush_cache) or what JSON encodes."""
        text = isinstance(body, str)
        data = body.encode() if text else json.dumps(body).encode()
        if self._unread:  # what follows on this connection is the rest of a body, not a request
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        key = self.server.api_key
        if not key or self.path == "/health":
            return True
        if bearer_matches(self.headers.get("Authorization", ""), key):
            return True
        self._reply(HTTPStatus.UNAUTHORIZED, {"error": {"message": "missing or wrong bearer token"}})
        return False

    def _body(self, path: str) -> dict:
        raw = self._read_body(self.server.body_limit(path))
        self._unread = False
        return parse_body(raw) if raw else {}

    def _read_body(self, limit: int) -> bytes:
        encoding = self.headers.get("Transfer-Encoding")
        length = self.headers.get("Content-Length")
        if encoding is not None:
            if length is not None:
                raise BadRequest(HTTPStatus.BAD_REQUEST, "a request may not carry both Transfer-Encoding and "
                                                         "Content-Length")
            if encoding.strip().lower() != "chunked":
                raise BadRequest(HTTPStatus.NOT_IMPLEMENTED, f"Transfer-Encoding {encoding!r}: only chunked is taken")
            return read_chunked(self.rfile, limit)
        try:
            n = int(length or 0)
        except ValueError:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"Content-Length {length!r} is not a number") from None
        if n < 0:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"Content-Length {n} is negative")
        if n > limit:
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"body of {n} bytes exceeds the limit of {limit} bytes")
        raw = self.rfile.read(n) if n else b""
        if len(raw) < n:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"body cut short: {len(raw)} of {n} bytes")
        return raw

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        self._unread = announces_body(self.headers)
        path = self.path.split("?", 1)[0]
        if self.reserve:  # past max_connections: GET /health only, then closed
            self.close_connection = True
            if (method, path) != ("GET", "/health"):
                exc = BadRequest(HTTPStatus.SERVICE_UNAVAILABLE, self.server.busy_message())
                self._reply(exc.status, _error(exc))
                return
        if not self._authorised():  # before any body is read
            return
        route = self.server.routes.get((method, path)) or (
            self.server.routes.get(("POST", path)) if path == "/flush_cache" else None
        )
        try:
            if route is None:
                allowed = [m for (m, p) in self.server.routes if p == path]
                if allowed:
                    raise BadRequest(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {', '.join(allowed)}, not {method}")
                raise BadRequest(HTTPStatus.NOT_FOUND, f"no route {method} {path}")
            request = decode_body(path, self._body(path) if method == "POST" else {})
        except BadRequest as exc:
            self._reply(exc.status, _error(exc))
            return
        try:
            status, reply = route(request)
        except BadRequest as exc:
            status, reply = exc.status, _error(exc)
        except UpdateInFlight as exc:
            status, reply = HTTPStatus.CONFLICT, {"success": False, "message": str(exc)}
        except EngineUnavailable as exc:
            status, reply = HTTPStatus.SERVICE_UNAVAILABLE, {"success": False, "message": str(exc)}
        except EngineFailure as exc:
            status, reply = HTTPStatus.BAD_REQUEST, {"success": False, "message": str(exc)}
        except (KeyError, TypeError, ValueError) as exc:
            status, reply = HTTPStatus.BAD_REQUEST, {"object": "error", "message": f"bad request: {exc!r}", "code": 400}
        except Exception as exc:  # noqa: BLE001 — never drop a connection without an answer
            status = HTTPStatus.INTERNAL_SERVER_ERROR
            reply = {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        self._reply(status, reply)


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


class _ReserveHandler(_Handler):
    """A connection past ``max_connections``: its one request read within ``reserve_read_s``, answered if it is
    ``GET /health`` (503 otherwise), and the connection closed."""

    reserve = True


def _group_name(b: dict) -> str:
    return b.get("group_name", "weight_update_group")


def _dense_bucket(x: dict, checksum: str | None = None, delta: dict | None = None) -> DenseBucket:
    """A broadcast bucket as a request names it (``names``, ``dtypes``, ``shapes``: checked before)."""
    return DenseBucket(tuple(x["names"]), tuple(x["dtypes"]), tuple(tuple(s) for s in x["shapes"]), checksum, delta)


def _rank_bucket(r: dict) -> RankBucket:
    """A per-rank bucket (or part of one) as a request names it (``src``, ``metas``, ``nbytes``, optional
    ``checksum`` and ``delta``)."""
    return RankBucket(int(r["src"]), tuple(r["metas"]), int(r["nbytes"]), r.get("checksum"), r.get("delta"))


def _entry_problems(entries: list) -> list[str]:
    """What is wrong with a per-rank bucket's entries: each must give ``src`` (int), ``metas`` (list) and
    ``nbytes`` (int)."""
    return [f"entry {k}: needs 'src' (int), 'metas' (list) and 'nbytes' (int)" for k, e in enumerate(entries)
            if not (isinstance(e, dict) and isinstance(e.get("src"), int) and isinstance(e.get("metas"), list)
                    and isinstance(e.get("nbytes"), int))]


class EngineServer(ThreadingHTTPServer):
    """The engine's HTTP face: one thread per connection, at most ``limits.max_connections`` of them."""

    daemon_threads = True

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 limits: ServerLimits = ServerLimits()):
        self.request_queue_size = limits.listen_backlog  # the listen() backlog, set as the socket is bound
        super().__init__((host, port), _Handler)
        self.engine = engine
        self.api_key = api_key
        self.limits = limits
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        self.reserve = threading.BoundedSemaphore(limits.reserve_connections)  # past slots: GET /health only
        self.connections_open = 0  # connections with a thread of their own now (slots and reserve)
        self._counting = threading.Lock()
        if not api_key:
            log(f"WARNING: no API key: any process that can reach {self.url} can load weights into this engine, "
                "pause it and free its memory (set WEIGHTSTREAM_API_KEY or --api-key-file)")
        e = engine
        self.routes: dict[tuple[str, str], Callable[[Any], tuple[int, Any]]] = {
            ("GET", "/health"): self.health,
            ("GET", "/model_info"): lambda b: (200, {"model_path": e.model_dir, "weight_version": e.weight_version,
                                                     "is_generation": True}),
            ("GET", "/get_server_info"): self.server_info,
            ("POST", "/init_weights_update_group"): self.init_group,
            ("POST", "/destroy_weights_update_group"): self.destroy_group,
            ("POST", "/update_weights_from_distributed"): self.update_distributed,
            ("POST", "/weightstream/update_weights_from_distributed_ahead"): self.update_distributed_ahead,
            ("POST", "/update_weights_from_tensor"): self.update_tensor,
            ("POST", "/weightstream/update_weights_from_ipc_ahead"): self.update_ipc_ahead,
            ("POST", "/weightstream/update_weights_from_p2p"): self.update_p2p,
            ("POST", "/weightstream/update_weights_from_p2p_ahead"): self.update_p2p_ahead,
            ("POST", "/weightstream/release_ipc_buffers"): self.release_ipc,
            ("POST", "/weightstream/prepare_ipc_ahead"): self.prepare_ipc_ahead,
            ("POST", "/begin_weight_update"): self.begin,
            ("POST", "/end_weight_update"): self.end,
            ("POST", "/weightstream/prepare_weight_update"): self.prepare_commit,
            ("POST", "/weightstream/abort_weight_update"): self.abort,
            ("POST", "/pause_generation"): self.pause,
            ("POST", "/continue_generation"): self.resume,
            ("POST", "/update_weight_version"): self.update_version,
            ("POST", "/flush_cache"): lambda b: (200, "Cache flushed.\n"),
            ("POST", "/generate"): self.generate,
            ("POST", "/weightstream/logits"): self.logits,
            ("POST", "/release_memory_occupation"): self.release_memory,
            ("POST", "/resume_memory_occupation"): self.resume_memory,
            ("GET", "/weightstream/memory"): lambda b: (200, {"ranks": self.engine.call(Memory())}),
            ("GET", "/weightstream/delta_checksums"): self.delta_checksums,
            ("GET", "/weightstream/update_phases"): self.update_phases,
            ("GET", "/weightstream/layout"): self.layout,
            ("POST", "/weightstream/weight_checksums"): self.weight_checksums,
        }

    def handle_error(self, request, client_address) -> None:
        """A client that went away (or a request cut by shutdown) is not worth a traceback."""
        exc = sys.exc_info()[1]
        if self.engine.stopping or isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        log(f"request from {client_address[0]}:{client_address[1]} failed: {type(exc).__name__}: {exc}")

    def body_limit(self, path: str) -> int:
        return self.limits.max_body_bytes if path in BULK_ROUTES else self.limits.max_small_body_bytes

    # A TCP server's request is its connection's socket: typeshed types every server's as a TCP or a UDP one.
    def process_request(self, request: socket.socket, client_address) -> None:  # type: ignore[override]
        """A thread for the connection: one of ``max_connections``, else one of ``reserve_connections`` (it may
        ask for ``GET /health`` only, so that slow or idle clients holding every connection do not make the engine
        look down); past both it is answered 503 and closed at once, here in the accepting thread."""
        if self.slots.acquire(blocking=False):
            handler, slots = _Handler, self.slots
        elif self.reserve.acquire(blocking=False):
            handler, slots = _ReserveHandler, self.reserve
        else:
            raw_reply(request, HTTPStatus.SERVICE_UNAVAILABLE, self.busy_message())
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self._serve_connection, args=(request, client_address, handler, slots),
                                  name="weightstream-engine-connection", daemon=True)
        self._count(+1)
        try:
            thread.start()
        except BaseException:  # no thread started: the slot is free again
            self._count(-1)
            slots.release()
            raise

    def _count(self, change: int) -> None:
        with self._counting:
            self.connections_open += change

    def _serve_connection(self, request: socket.socket, client_address, handler: type[_Handler],
                          slots: threading.BoundedSemaphore) -> None:
        try:
            handler(request, client_address, self)
        except Exception:  # noqa: BLE001 — as socketserver does: logged (handle_error), the server goes on
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._count(-1)
            slots.release()

    def busy_message(self) -> str:
        return (f"this engine serves at most {self.limits.max_connections} connections at once (GET /health is "
                "still answered); try again")

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if isinstance(host, (bytes, bytearray)):  # typed as any address bind() takes; bound, it is text
            host = host.decode()
        return f"http://{host}:{port}"

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

    def _in_session(self, what: str) -> None:
        if not self.engine.session_open:
            raise EngineFailure(f"{what} must run between begin_weight_update() and end_weight_update()")

    def _record(self, results, b) -> tuple[int, dict]:
        loaded = int(results[0]["loaded"]) if results and isinstance(results[0], dict) else 0
        self.engine.session_loaded += loaded
        msg = f"Succeeded to update weights ({loaded} tensors)."
        nonfinite = sorted({n for r in results if isinstance(r, dict) for n in r.get("nonfinite", ())})
        if nonfinite:  # loaded as they are (an engine started with --refuse-nonfinite refuses them)
            msg += f" NaN or an infinity in {len(nonfinite)} tensors of this session: {', '.join(nonfinite[:8])}"
        if b.get("weight_version") is not None:
            self.engine.pending_version = str(b["weight_version"])
        return 200, {"success": True, "message": msg}

    def _guarded(self, fn, b):
        """Run an update step; a failure marks the session failed (the update is then not complete). From
        the first step on, the weights are not served until the session ends (:meth:`Engine.check_settled`)."""
        self.engine.session_touched = True
        ranks = b.get("ranks") if isinstance(b.get("ranks"), list) else []
        if b.get("weightstream_delta") is None and b.get("weightstream_delta_mode") is not True \
                and not any(isinstance(r, dict) and r.get("delta") for r in ranks):
            self.engine.session_plain = True
        else:
            self.engine.session_delta = True
        try:
            return self._record(fn(), b)
        except EngineFailure as exc:
            self.engine.session_failed = str(exc)
            raise EngineFailure(f"Failed to update weights: {exc}. This session will not be committed: "
                                f"ending or aborting it: {self.engine.after_abort()}.") from None

    def update_distributed(self, b):
        self._in_session("update_weights_from_distributed")
        bucket = _dense_bucket(b, b.get("weightstream_checksum"), b.get("weightstream_delta"))
        receive = Receive(ReceivePlan(Transport.BROADCAST, delta=bucket.delta is not None), _group_name(b),
                          (bucket,), b.get("load_format"))
        return self._guarded(lambda: self.engine.call(receive), b)

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

    def update_distributed_ahead(self, b):
        self._in_session("update_weights_from_distributed_ahead")
        plan = ReceivePlan(Transport.BROADCAST, ahead=True, delta=b.get("weightstream_delta_mode") is True)
        receive = Receive(plan, _group_name(b), tuple(_dense_bucket(x) for x in b["buckets"]), b.get("load_format"))
        return self._guarded(lambda: self.engine.call(receive), b)

    def update_tensor(self, b):
        self._in_session("update_weights_from_tensor")
        payloads = b["serialized_named_tensors"]
        if isinstance(payloads, str):
            payloads = [payloads]
        if len(payloads) != self.engine.tp:
            raise EngineFailure(f"got {len(payloads)} payloads for {self.engine.tp} engine TP ranks")
        checksums = b.get("weightstream_checksums") or [None] * self.engine.tp
        per_rank = [TensorReceive(p, b.get("load_format"), checksums[r]) for r, p in enumerate(payloads)]
        return self._guarded(lambda: self.engine.call(per_rank), b)

    def update_ipc_ahead(self, b):
        self._in_session("update_weights_from_ipc_ahead")
        timeout_s, per_rank = self._ipc_ranks(b, delta=b.get("weightstream_delta_mode") is True)
        # The workers answer once the last bucket is loaded: each frame waits at most timeout_s.
        bound = timeout_s * (b["num_buckets"] + 3)
        return self._guarded(lambda: self.engine.call(per_rank, wait_s=bound), b)

    def prepare_ipc_ahead(self, b):
        """Outside any session: the workers learn a trainer's plan and map its kept buffers."""
        timeout_s, per_rank = self._ipc_ranks(b, prepare=True)
        held = self.engine.call(per_rank, wait_s=timeout_s * 4)
        return 200, {"success": True, "message": f"prepared; IPC buffers held per rank: {[h['held'] for h in held]}"}

    def _ipc_ranks(self, b, delta: bool = False, prepare: bool = False) -> tuple[float, list[IpcReceive]]:
        """The bound of each wait on the trainer, and each worker's receive (its channel)."""
        if len(b["channels"]) != self.engine.tp:
            raise EngineFailure(f"got {len(b['channels'])} control channels for {self.engine.tp} engine TP ranks")
        timeout_s = float(b.get("timeout_s") or self.engine.session_timeout_s)
        return timeout_s, [IpcReceive(b["plan"], b["num_buckets"], c, b["client"], timeout_s, delta, prepare)
                           for c in b["channels"]]

    def release_ipc(self, r: ReleaseIpcRequest):
        released = sum(rank["released"] for rank in self.engine.call(ReleaseIpc(r.client)))
        return 200, {"success": True, "message": f"closed {released} IPC buffers of this client"}

    def update_p2p(self, b):
        self._in_session("update_weights_from_p2p")
        ranks = b["ranks"]
        if any("rank" in r for r in ranks):
            return self._update_p2p_pieces(b)
        if len(ranks) != self.engine.tp:
            raise EngineFailure(f"got metadata for {len(ranks)} ranks, engine has {self.engine.tp}")
        problems = [f"rank {k}: {p}" for k, r in enumerate(ranks) for p in delta_problems(r.get("delta"))]
        if problems:
            raise BadRequest(HTTPStatus.BAD_REQUEST, "bad delta headers: " + "; ".join(problems))
        per_rank = [Receive(ReceivePlan(Transport.P2P, delta=r.get("delta") is not None), _group_name(b),
                            (_rank_bucket(r),)) for r in ranks]
        return self._guarded(lambda: self.engine.call(per_rank), b)

    def update_p2p_ahead(self, b):
        """Every per-rank bucket of an update: per bucket, one entry per engine rank (``src``, ``metas``,
        ``nbytes``), or, resharded, entries that each name the engine rank they are for (``rank``: see
        :meth:`_update_p2p_pieces`); each rank receives its buckets back to back."""
        self._in_session("update_weights_from_p2p_ahead")
        buckets = b["buckets"]
        problems = [f"bucket {i}: {p}" for i, x in enumerate(buckets)
                    for p in (_entry_problems(x) if isinstance(x, list) else ["not a list of entries"])]
        if problems:
            raise BadRequest(HTTPStatus.BAD_REQUEST, "bad P2P buckets: " + "; ".join(problems[:8]))
        group = _group_name(b)
        delta = b.get("weightstream_delta_mode") is True
        if any("rank" in e for x in buckets for e in x):
            per_bucket = [self._parts_per_rank(x) for x in buckets]
            pieces = ReceivePlan(Transport.PIECES, ahead=True, delta=delta)
            per_rank = [Receive(pieces, group, tuple(parts[r] for parts in per_bucket)) for r in range(self.engine.tp)]
            return self._guarded(lambda: self.engine.call(per_rank), b)
        problems = [f"bucket {i}: {len(x)} entries, the engine has {self.engine.tp} ranks"
                    for i, x in enumerate(buckets) if len(x) != self.engine.tp]
        if problems:
            raise BadRequest(HTTPStatus.BAD_REQUEST, "bad P2P buckets: " + "; ".join(problems[:8]))
        plan = ReceivePlan(Transport.P2P, ahead=True, delta=delta)
        per_rank = [Receive(plan, group, tuple(RankBucket(x[r]["src"], tuple(x[r]["metas"]), x[r]["nbytes"])
                                               for x in buckets)) for r in range(self.engine.tp)]
        return self._guarded(lambda: self.engine.call(per_rank), b)

    def _update_p2p_pieces(self, b):
        """A resharded bucket: each entry names the engine rank it is for (``rank``) and the trainer rank it
        comes from (``src``); an engine rank may hear several trainer ranks, or none."""
        delta = any(isinstance(r, dict) and r.get("delta") is not None for r in b["ranks"])
        per_rank = [Receive(ReceivePlan(Transport.PIECES, delta=delta), _group_name(b), (parts,))
                    for parts in self._parts_per_rank(b["ranks"])]
        return self._guarded(lambda: self.engine.call(per_rank), b)

    def _parts_per_rank(self, entries: list) -> list[tuple[RankBucket, ...]]:
        """A resharded bucket's entries (each ``rank``, ``src``, ``metas``, ``nbytes``, optional ``checksum`` and
        ``delta``) as the parts each engine rank receives; every problem in one error."""
        problems = [f"part {k}: {p}" for k, r in enumerate(entries) for p in delta_problems(r.get("delta"))]
        if problems:
            raise BadRequest(HTTPStatus.BAD_REQUEST, "bad delta headers: " + "; ".join(problems))
        parts: list[list[RankBucket]] = [[] for _ in range(self.engine.tp)]
        for r in entries:
            rank = r.get("rank")
            if not isinstance(rank, int) or not 0 <= rank < self.engine.tp:
                raise EngineFailure(f"a part for engine rank {rank!r}; the engine has ranks 0..{self.engine.tp - 1}")
            parts[rank].append(_rank_bucket(r))
        return [tuple(p) for p in parts]

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
