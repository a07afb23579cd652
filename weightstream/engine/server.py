"""The embedded reference engine: an HTTP server speaking SGLang's weight-update protocol.

``weightstream engine --model DIR --tp N`` starts N worker processes (one per engine TP rank, each
holding its shard) and serves, on loopback by default:

- SGLang's protocol: ``/init_weights_update_group``, ``/update_weights_from_distributed``
  (per tensor or ``flattened_bucket``), ``/update_weights_from_tensor``, ``/destroy_weights_update_group``,
  ``/pause_generation``, ``/continue_generation``, ``/begin_weight_update``, ``/end_weight_update``,
  ``/update_weight_version``, ``/flush_cache``, ``/generate``, ``/model_info``, ``/get_server_info``, ``/health``;
- weightstream's additions: ``/weightstream/update_weights_from_p2p`` (per-rank buckets by send/recv) and
  ``/weightstream/logits``.

Every reply to a weight-update call is ``{"success": bool, "message": str}`` (HTTP 200 or 400); the
optional bearer token is checked on every route but ``/health``.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.multiprocessing as mp

from weightstream.launch import free_port
from weightstream.streaming.serialization import gpu_uuid

ENGINE_NAME = "weightstream-reference"


class EngineFailure(RuntimeError):
    """A request the engine could not carry out (reported as success=false)."""


class Engine:
    """The worker processes of one engine and the state the HTTP routes act on."""

    def __init__(self, model_dir: str, tp: int = 1, *, device: str | None = None, dtype: str = "float32",
                 command_timeout_s: float = 300.0, start_timeout_s: float = 300.0):
        self.model_dir = os.path.abspath(model_dir)
        self.tp = tp
        self.dtype = dtype
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.devices = [f"cuda:{r % torch.cuda.device_count()}" if device == "cuda" else device for r in range(tp)]
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        self.command_timeout_s = command_timeout_s
        self.weight_version = "default"
        self.paused = threading.Event()
        self.pending_version: str | None = None
        self.session_open = False
        self.session_failed: str | None = None
        self.session_loaded = 0
        self.lock = threading.Lock()  # one command at a time through the workers
        from weightstream.engine.worker import worker_main

        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, tp, self.model_dir, port, self.backend, self.devices[rank], dtype, child),
                daemon=True,
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        deadline = time.monotonic() + start_timeout_s
        for rank, conn in enumerate(self.conns):
            ok, msg = self._recv(rank, conn, deadline - time.monotonic(), "start")
            if not ok:
                self.shutdown()
                raise EngineFailure(f"engine rank {rank} failed to start:\n{msg}")

    def _recv(self, rank: int, conn, timeout: float, what: str):
        step = 0.5
        waited = 0.0
        while not conn.poll(step):
            waited += step
            if not self.procs[rank].is_alive():
                raise EngineFailure(f"engine rank {rank} died (exit code {self.procs[rank].exitcode}) during {what}")
            if waited >= timeout:
                raise EngineFailure(f"engine rank {rank} did not answer {what} within {timeout:.0f} s")
        try:
            return conn.recv()
        except (EOFError, OSError):
            self.procs[rank].join(timeout=5)
            raise EngineFailure(
                f"engine rank {rank} died (exit code {self.procs[rank].exitcode}) during {what}"
            ) from None

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def call(self, command: str, per_rank: list[dict] | None = None, **kwargs) -> list[Any]:
        """Run ``command`` on every worker; returns their results or raises naming the failing ranks."""
        timeout = self.command_timeout_s
        with self.lock:
            for rank, conn in enumerate(self.conns):
                if not self.procs[rank].is_alive():
                    raise EngineFailure(f"engine rank {rank} is not running (exit code {self.procs[rank].exitcode})")
                conn.send((command, per_rank[rank] if per_rank is not None else kwargs))
            deadline = time.monotonic() + timeout
            replies = [self._recv(r, c, deadline - time.monotonic(), command) for r, c in enumerate(self.conns)]
        failed = [f"rank {r}: {msg}" for r, (ok, msg) in enumerate(replies) if not ok]
        if failed:
            raise EngineFailure(" | ".join(failed))
        return [msg for _, msg in replies]

    def gpu_uuids(self) -> list[str]:
        if self.backend != "nccl":
            return []
        return [gpu_uuid(torch.device(d)) for d in self.devices]

    def shutdown(self) -> None:
        for rank, conn in enumerate(self.conns):
            try:
                if self.procs[rank].is_alive():
                    conn.send(("shutdown", {}))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    server: "EngineServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet
        pass

    def _reply(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        key = self.server.api_key
        if not key or self.path == "/health":
            return True
        if self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self._reply(HTTPStatus.UNAUTHORIZED, {"error": {"message": "missing or wrong bearer token"}})
        return False

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if not n:
            return {}
        return json.loads(self.rfile.read(n))

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        if not self._authorised():
            return
        path = self.path.split("?", 1)[0]
        route = self.server.routes.get((method, path)) or (
            self.server.routes.get(("POST", path)) if path == "/flush_cache" else None
        )
        if route is None:
            self._reply(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {method} {path}"}})
            return
        try:
            body = self._body() if method == "POST" else {}
        except (ValueError, json.JSONDecodeError) as exc:
            self._reply(HTTPStatus.BAD_REQUEST, {"object": "error", "message": f"bad JSON: {exc}", "code": 400})
            return
        try:
            status, reply = route(body)
        except EngineFailure as exc:
            status, reply = HTTPStatus.BAD_REQUEST, {"success": False, "message": str(exc)}
        except (KeyError, TypeError, ValueError) as exc:
            status, reply = HTTPStatus.BAD_REQUEST, {"object": "error", "message": f"bad request: {exc!r}", "code": 400}
        except Exception as exc:  # noqa: BLE001 — never drop a connection without an answer
            status, reply = HTTPStatus.INTERNAL_SERVER_ERROR, {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        self._reply(status, reply)


class EngineServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
        super().__init__((host, port), _Handler)
        self.engine = engine
        self.api_key = api_key
        e = engine
        self.routes = {
            ("GET", "/health"): lambda b: (200 if e.alive() else 503, {}),
            ("GET", "/model_info"): lambda b: (200, {"model_path": e.model_dir, "weight_version": e.weight_version,
                                                     "is_generation": True}),
            ("GET", "/get_server_info"): self.server_info,
            ("POST", "/init_weights_update_group"): self.init_group,
            ("POST", "/destroy_weights_update_group"): self.destroy_group,
            ("POST", "/update_weights_from_distributed"): self.update_distributed,
            ("POST", "/update_weights_from_tensor"): self.update_tensor,
            ("POST", "/weightstream/update_weights_from_p2p"): self.update_p2p,
            ("POST", "/begin_weight_update"): self.begin,
            ("POST", "/end_weight_update"): self.end,
            ("POST", "/pause_generation"): self.pause,
            ("POST", "/continue_generation"): self.resume,
            ("POST", "/update_weight_version"): self.update_version,
            ("POST", "/flush_cache"): lambda b: (200, "Cache flushed.\n"),
            ("POST", "/generate"): self.generate,
            ("POST", "/weightstream/logits"): self.logits,
        }

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    # -- routes -------------------------------------------------------------------------------

    def server_info(self, body):
        e = self.engine
        return 200, {
            "engine": ENGINE_NAME, "tp_size": e.tp, "pp_size": 1, "dp_size": 1, "model_path": e.model_dir,
            "weight_version": e.weight_version, "device": e.devices[0].split(":")[0], "gpu_uuids": e.gpu_uuids(),
            "hostname": socket.gethostname(), "pid": os.getpid(), "dtype": e.dtype,
            "weightstream_p2p": True,
        }

    def init_group(self, b):
        msgs = self.engine.call(
            "init_group", master_address=b["master_address"], master_port=int(b["master_port"]),
            rank_offset=int(b["rank_offset"]), world_size=int(b["world_size"]),
            group_name=b.get("group_name", "weight_update_group"), backend=b.get("backend", "nccl"),
            timeout_s=float(b.get("timeout_s", 60.0)),
        )
        return 200, {"success": True, "message": " | ".join(msgs)}

    def destroy_group(self, b):
        self.engine.call("destroy_group", group_name=b.get("group_name", "weight_update_group"))
        return 200, {"success": True, "message": "destroyed"}

    def _in_session(self, what: str) -> None:
        if not self.engine.session_open:
            raise EngineFailure(f"{what} must run between begin_weight_update() and end_weight_update()")

    def _record(self, results, b) -> tuple[int, dict]:
        loaded = len(results[0]["loaded"]) if results and isinstance(results[0], dict) else 0
        self.engine.session_loaded += loaded
        msg = f"Succeeded to update weights ({loaded} tensors)."
        if b.get("weight_version") is not None:
            self.engine.pending_version = str(b["weight_version"])
        return 200, {"success": True, "message": msg}

    def _guarded(self, fn, b):
        """Run an update step; a failure marks the session failed (the update is then not complete)."""
        try:
            return self._record(fn(), b)
        except EngineFailure as exc:
            self.engine.session_failed = str(exc)
            raise EngineFailure(f"Failed to update weights: {exc}. The weights are partially updated; "
                                "this session will not be committed.") from None

    def update_distributed(self, b):
        self._in_session("update_weights_from_distributed")
        return self._guarded(lambda: self.engine.call(
            "update_distributed", names=list(b["names"]), dtypes=list(b["dtypes"]),
            shapes=[list(s) for s in b["shapes"]], group_name=b.get("group_name", "weight_update_group"),
            load_format=b.get("load_format"), expected_checksum=b.get("weightstream_checksum"),
        ), b)

    def update_tensor(self, b):
        self._in_session("update_weights_from_tensor")
        payloads = b["serialized_named_tensors"]
        if isinstance(payloads, str):
            payloads = [payloads]
        if len(payloads) != self.engine.tp:
            raise EngineFailure(f"got {len(payloads)} payloads for {self.engine.tp} engine TP ranks")
        per_rank = [{"payload": p, "load_format": b.get("load_format"),
                     "expected_checksum": (b.get("weightstream_checksums") or [None] * self.engine.tp)[r]}
                    for r, p in enumerate(payloads)]
        return self._guarded(lambda: self.engine.call("update_tensor", per_rank=per_rank), b)

    def update_p2p(self, b):
        self._in_session("update_weights_from_p2p")
        ranks = b["ranks"]
        if len(ranks) != self.engine.tp:
            raise EngineFailure(f"got metadata for {len(ranks)} ranks, engine has {self.engine.tp}")
        group = b.get("group_name", "weight_update_group")
        per_rank = [{"group_name": group, "src": int(r["src"]), "metas": r["metas"], "nbytes": int(r["nbytes"]),
                     "expected_checksum": r.get("checksum")} for r in ranks]
        return self._guarded(lambda: self.engine.call("update_p2p", per_rank=per_rank), b)

    def begin(self, b):
        e = self.engine
        if e.session_open:
            raise EngineFailure("a weight update session is already open")
        e.session_open, e.session_failed, e.session_loaded, e.pending_version = True, None, 0, None
        return 200, {"success": True, "message": "weight update session opened"}

    def end(self, b):
        e = self.engine
        if not e.session_open:
            raise EngineFailure("no weight update session is open")
        e.session_open = False
        e.call("finish_update")
        if e.session_failed:
            raise EngineFailure(f"the session failed and was not committed: {e.session_failed}")
        if e.pending_version is not None:
            e.weight_version = e.pending_version
        return 200, {"success": True, "message": f"committed {e.session_loaded} tensors; weight_version {e.weight_version}"}

    def pause(self, b):
        self.engine.paused.set()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, b):
        self.engine.paused.clear()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def update_version(self, b):
        self.engine.weight_version = str(b["new_version"])
        return 200, {"success": True, "message": f"Weight version updated to {b['new_version']}",
                     "new_version": self.engine.weight_version}

    def _wait_unpaused(self) -> None:
        deadline = time.monotonic() + self.engine.command_timeout_s
        while self.engine.paused.is_set():
            if time.monotonic() > deadline:
                raise EngineFailure("generation stayed paused past the request's time limit")
            time.sleep(0.05)

    def generate(self, b):
        self._wait_unpaused()
        ids = b["input_ids"]
        n = int((b.get("sampling_params") or {}).get("max_new_tokens", 16))
        batch = ids if ids and isinstance(ids[0], list) else [ids]
        outs = []
        for seq in batch:
            out = self.engine.call("generate", input_ids=seq, max_new_tokens=n)[0]
            outs.append({"text": "", "output_ids": out, "meta_info": {
                "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(seq),
                "completion_tokens": len(out), "weight_version": self.engine.weight_version}})
        return 200, outs if batch is ids else outs[0]

    def logits(self, b):
        self._wait_unpaused()
        out = self.engine.call("logits", input_ids=b["input_ids"])[0]
        return 200, {"shape": list(out.shape), "dtype": "float32",
                     "logits_b64": base64.b64encode(out.contiguous().numpy().tobytes()).decode(),
                     "weight_version": self.engine.weight_version}


def serve(model_dir: str, tp: int = 1, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
          device: str | None = None, dtype: str = "float32") -> EngineServer:
    """Start an engine and its HTTP server (serving in a background thread); returns the server."""
    engine = Engine(model_dir, tp, device=device, dtype=dtype)
    server = EngineServer(engine, host, port, api_key)
    threading.Thread(target=server.serve_forever, name="weightstream-engine-http", daemon=True).start()
    return server


def stop(server: EngineServer) -> None:
    server.shutdown()
    server.server_close()
    server.engine.shutdown()
