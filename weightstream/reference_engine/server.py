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
  the ``*_ahead`` routes (every bucket's metadata in one request; a broadcast's plan, once kept, by its key
  ``weightstream_plan`` alone: the keys kept are named in ``/begin_weight_update``'s reply; the workers keep the
  plans too, and each is sent the key alone where it said it holds the plan),
  ``/weightstream/prepare_broadcast_ahead`` (a broadcast plan made ready and kept before any update),
  ``/weightstream/logits``,
  ``/weightstream/prepare_weight_update`` (a commit's first phase, where a trainer commits several engines all
  or none) and ``/weightstream/abort_weight_update``, and two fields:
  ``pause`` in ``/begin_weight_update`` and ``resume`` in ``/end_weight_update`` (one request each instead
  of two).

Every reply to a weight-update call is ``{"success": bool, "message": str}`` (HTTP 200 or 400); the
optional bearer token is checked on every route but ``/health``. Each route runs on the typed request its body
decodes into (:func:`decode_body`), on the engine's ranks (:class:`~weightstream.reference_engine.ranks.Engine`);
the HTTP server under the routes is :class:`~weightstream.common.http_server.JsonHttpServer`.
"""

from __future__ import annotations

import base64
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any

from weightstream.common.http_server import BadRequest, HttpLimits, JsonHttpServer
from weightstream.engines.reference import ENGINE_NAME
from weightstream.receiver.ahead_plans import AheadPlans, plan_key
from weightstream.receiver.plan import DenseBucket
from weightstream.receiver.requests import (
    BROADCAST_AHEAD_ROUTE,
    BROADCAST_ROUTE,
    P2P_AHEAD_ROUTE,
    P2P_ROUTE,
    PREPARE_BROADCAST_ROUTE,
    PREPARE_IPC_ROUTE,
    TENSOR_ROUTE,
    UPDATE_SCHEMAS,
    UPDATES,
    BeginRequest,
    BroadcastUpdate,
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
from weightstream.receiver.values import DEFAULT_CHECKS, LoadChecks
from weightstream.reference_engine.protocol import (
    DeltaChecksums,
    Generate,
    GenerateRequest,
    Layout,
    LogitsRequest,
    Memory,
    ReleaseMemoryRequest,
    ResumeMemoryRequest,
    UpdatePhases,
)
from weightstream.reference_engine.ranks import (
    Engine,
    EngineFailure,
    EngineUnavailable,
    UpdateInFlight,
    WorkOutOfTime,
    log,
)
from weightstream.reference_engine.worker import worker_main

__all__ = ["BULK_ROUTES", "ServerLimits", "REQUESTS", "SCHEMAS", "decode_body", "EngineServer", "serve", "stop"]


# Routes whose bodies carry weights or the metadata of every bucket: these may be up to ``max_body_bytes``;
# every other route's body is small (``max_small_body_bytes``).
BULK_ROUTES = frozenset({BROADCAST_ROUTE, BROADCAST_AHEAD_ROUTE, TENSOR_ROUTE, P2P_ROUTE, P2P_AHEAD_ROUTE,
                         PREPARE_BROADCAST_ROUTE})


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
        # Broadcast plans sent ahead, by the key this engine gave each; and what each rank last said it keeps of them
        # (a rank is sent a plan's key alone only where it named the key).
        self.ahead_plans: AheadPlans[tuple[DenseBucket, ...]] = AheadPlans()
        self.rank_plans: list[frozenset[str]] = [frozenset()] * engine.tp
        self.rank_plans_lock = threading.Lock()
        if not api_key:
            log(f"WARNING: no API key: any process that can reach {self.url} can load weights into this engine, "
                "pause it and free its memory (set WEIGHTSTREAM_API_KEY or --api-key-file)")
        e = engine
        self.routes.update({("POST", route): self.update for route in UPDATES
                            if route not in (PREPARE_IPC_ROUTE, PREPARE_BROADCAST_ROUTE)})
        self.routes.update({
            ("GET", "/health"): self.health,
            ("GET", "/model_info"): lambda b: (200, {"model_path": e.model_dir, "weight_version": e.weight_version,
                                                     "is_generation": True}),
            ("GET", "/get_server_info"): self.server_info,
            ("POST", "/init_weights_update_group"): self.init_group,
            ("POST", "/destroy_weights_update_group"): self.destroy_group,
            ("POST", "/weightstream/release_ipc_buffers"): self.release_ipc,
            ("POST", PREPARE_IPC_ROUTE): self.prepare_ipc_ahead,
            ("POST", PREPARE_BROADCAST_ROUTE): self.prepare_broadcast_ahead,
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
            "capabilities": ["broadcast", "ipc", "ipc_ahead", "ipc_session", "p2p", "reshard", "release_memory"]
            + (["rollback"] if e.rollback else [])
            + ["broadcast_ahead", "p2p_ahead", "delta", "delta_ahead", "warm_group", "broadcast_prepare"],
            "instance": e.instance, "delta_base": e.delta_base,
            "update_session_open": e.session_open,
            "update_session_loaded": e.session_loaded,  # tensors loaded in the open session so far
            "worker_pids": [p.pid for p in e.procs],
        }

    def init_group(self, r: InitGroupRequest):
        msgs = self.engine.call(r, wait_s=r.timeout_s + 5.0)  # timeout_s: the trainer's; the workers give up at it
        return 200, {"success": True, "message": " | ".join(msgs)}

    def destroy_group(self, r: DestroyGroupRequest):
        self.engine.call(r)
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
        if isinstance(r, IpcUpdate) and r.begin is not None:  # ipc_session: the session opened here first
            self._open_session(r.begin, workers=False)  # (each worker opens its own with its receive)
        if not e.session_open:
            raise EngineFailure(f"{r.route.rsplit('/', 1)[1]} must run between begin_weight_update() and "
                                "end_weight_update()")
        r = self._resolved(r)
        receives = self._receives(r)
        key = self._key(r)
        e.session_touched = True
        if r.delta:
            e.session_delta = True
        else:
            e.session_plain = True
        try:
            results = self._call(r, receives, key)
        except EngineFailure as exc:
            e.session_failed = str(exc)
            raise EngineFailure(f"Failed to update weights: {exc}. This session will not be committed: "
                                f"ending or aborting it: {e.after_abort()}.") from None
        reply = {"success": True, "message": self._loaded(results, r.weight_version), **self._kept(r, key)}
        if isinstance(r, IpcUpdate) and r.commit is not None:
            reply.update(self._commit_folded(r.commit, results))
        return 200, reply

    def _commit_folded(self, commit: CommitRequest, results: list[Any]) -> dict[str, Any]:
        """``ipc_session``: the session this request opened is committed (as :meth:`end` with ``commit``; at TP 1
        the worker committed its own with its receive), where every rank's trainer rank let it in its last frame;
        else it stays open, for the trainer to abort."""
        if not all(isinstance(x, dict) and x.get("commit") is True for x in results):
            return {"committed": False, "weight_version": self.engine.weight_version}
        message = self._commit_session(commit, workers=not all(x.get("committed") is True for x in results))
        return {"committed": True, "weight_version": self.engine.weight_version,
                "message": f"{message} (committed with the update)"}

    def _call(self, r: UpdateRequest, receives: RankReceives, key: str | None) -> list[Any]:
        """Run each rank's receive of ``r``: a broadcast whose plan is kept by ``key`` goes to each rank as the key
        alone where that rank's last answer named it, else with the buckets and the key
        (:meth:`BroadcastUpdate.keyed_receives`); each rank's answer names the keys it holds after it. What the ranks
        hold is forgotten while they run (a failure leaves it unknown: the buckets go again)."""
        if key is None or not isinstance(r, BroadcastUpdate):
            return self.engine.call(list(receives.per_rank), wait_s=receives.wait_s)
        with self.rank_plans_lock:
            commands = r.keyed_receives(key, self.rank_plans)
            self.rank_plans = [frozenset()] * self.engine.tp
            results = self.engine.call(list(commands), wait_s=receives.wait_s)
            self.rank_plans = [frozenset(result["plans"]) for result in results]
        return results

    def _resolved(self, r: UpdateRequest) -> UpdateRequest:
        """A broadcast sent ahead by the key of a plan this engine keeps, with the plan's buckets (400, nothing
        received, where it keeps none by that key)."""
        if not isinstance(r, BroadcastUpdate) or r.plan_key is None:
            return r
        buckets = self.ahead_plans.get(r.plan_key)
        if buckets is None:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"bad request to {r.route}: no plan kept by key {r.plan_key} "
                             f"(this engine keeps {self.ahead_plans.keys()}): send its buckets")
        return replace(r, buckets=buckets)

    @staticmethod
    def _key(r: UpdateRequest) -> str | None:
        """The key of a broadcast's plan sent ahead (the key it came by, else this engine's digest of its buckets);
        None for any other update."""
        if not isinstance(r, BroadcastUpdate) or not r.ahead:
            return None
        return r.plan_key if r.plan_key is not None else plan_key(r.buckets)

    def _kept(self, r: UpdateRequest, key: str | None) -> dict[str, str]:
        """After a broadcast sent ahead loaded (``key``: its plan's): its plan kept, and its key answered
        (``weightstream_plan``)."""
        if key is None or not isinstance(r, BroadcastUpdate):
            return {}
        self.ahead_plans.put(key, r.buckets)
        return {"weightstream_plan": key}

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

    def prepare_broadcast_ahead(self, r: BroadcastUpdate):
        """Outside any update: the workers make a broadcast plan's loads ready (copy programs, receive buffers, checks:
        :meth:`CollectiveReceiver.prepare`), and the plan is kept under the key answered."""
        receives = self._receives(r)
        key = plan_key(r.buckets)
        self._call(r, receives, key)
        self.ahead_plans.put(key, r.buckets)
        return 200, {"success": True, "message": f"prepared {len(r.buckets)} buckets", "weightstream_plan": key}

    def prepare_ipc_ahead(self, r: IpcUpdate):
        """Outside any session: the workers learn a trainer's plan and map its kept buffers."""
        receives = self._receives(r)
        held = self.engine.call(list(receives.per_rank), wait_s=receives.wait_s)
        return 200, {"success": True, "message": f"prepared; IPC buffers held per rank: {[h['held'] for h in held]}"}

    def release_ipc(self, r: ReleaseIpcRequest):
        released = sum(rank["released"] for rank in self.engine.call(r))
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
        return 200, {"ranks": self.engine.call(r, committed=True)}

    def begin(self, r: BeginRequest):
        """``pause`` (a mode): pause generation first, as ``/pause_generation`` does (one request for both)."""
        self._open_session(r, workers=True)
        return 200, {"success": True, "message": "weight update session opened",
                     "weightstream_plans": self.ahead_plans.keys()}

    def _open_session(self, r: BeginRequest, workers: bool) -> None:
        """:meth:`begin`'s work; ``workers`` False: they open theirs with the update's receive (``ipc_session``)."""
        if r.pause:
            self.pause(PauseRequest(r.pause))
        self.engine.begin_session(r.timeout_s, workers=workers)
        if r.weight_version is not None:  # what the commit will serve, unless a bucket says otherwise
            self.engine.pending_version = r.weight_version

    def end(self, r: CommitRequest):
        """``resume``: generation continues once the session is committed (one request for both)."""
        message = self._commit_session(r, workers=True)
        return 200, {"success": True, "message": message, "weight_version": self.engine.weight_version}

    def _commit_session(self, r: CommitRequest, workers: bool) -> str:
        """:meth:`end`'s work; ``workers`` False: they committed theirs with the update's receive (``ipc_session``
        at TP 1)."""
        message = self.engine.commit_session(workers=workers)  # the engine has no cache of its own to flush
        if r.resume:
            self.resume(EmptyRequest())
        return message

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
        ranks = self.engine.call(r)
        if "weights" in r.tags:
            self.engine.weights_released = True
        return 200, {"success": True, "message": f"released {sum(r['freed_bytes'] for r in ranks)} bytes",
                     "ranks": ranks}

    def resume_memory(self, r: ResumeMemoryRequest):
        ranks = self.engine.call(r)
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
        out = self.engine.call(r, committed=True)[0]
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
