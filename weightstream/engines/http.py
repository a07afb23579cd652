"""Bounded JSON-over-HTTP calls to one engine: what every HTTP adapter (SGLang, vLLM, LMDeploy, the reference
engine) builds on."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
import urllib.parse
from collections import deque
from pathlib import Path
from typing import Any

from weightstream.engines.base import EngineError, EngineInfo, EngineUnreachable
from weightstream.engines.formats import stated_format
from weightstream.wire.fp8 import BlockFP8

__all__ = ["KEEP_ALIVE_S", "HTTPEngine"]

# How long a connection left open after a request is used again: well within the idle bound of the servers an
# engine runs (uvicorn closes after 5 s idle, our engine after 30 s), so that a request never goes out on a
# connection the server is closing; an update's requests follow each other within milliseconds.
KEEP_ALIVE_S = 2.0


class HTTPEngine:
    """Bounded JSON-over-HTTP calls to one engine; the plumbing every HTTP adapter shares. Requests go over
    connections kept open between them (one per request in flight; a connection idle more than
    :data:`KEEP_ALIVE_S` is closed, not used): an update's requests pay no connection set-up each."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                 group_name: str = "weight_update_group", fp8: BlockFP8 | None = None,
                 model_path: str | Path | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.group_name = group_name
        # The layout of the served model as the user states it (``fp8=``, or the ``quantization_config`` of
        # ``model_path``'s config.json): what an engine that does not report its layout serves.
        self.stated = stated_format(fp8, model_path)
        self._info: EngineInfo | None = None
        self._server_info: dict | None = None  # what the engine said it is (each adapter asks in its own way)
        self._session = False  # a session this client opened and has not ended
        self._version: str | None = None  # the weight version of that session
        self._parts = urllib.parse.urlsplit(self.url)  # where each connection goes, and the routes' prefix
        self._idle: deque[tuple[http.client.HTTPConnection, float]] = deque()  # (connection, when it was left)
        self._idle_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __getstate__(self) -> dict:
        """Pickled (to another process) without its open connections."""
        state = self.__dict__.copy()
        state["_idle"], state["_idle_lock"] = deque(), None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._idle_lock = threading.Lock()

    def request(self, method: str, path: str, body: Any = None, *, step: str | None = None,
                timeout_s: float | None = None) -> Any:
        step = step or path.strip("/")
        timeout = timeout_s or self.timeout_s
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            status, raw = self._exchange(method, path, data, headers, timeout)
        except (OSError, http.client.HTTPException) as exc:
            raise EngineUnreachable(self.url, step,
                                    f"unreachable or no answer within {timeout:.0f} s ({exc})") from None
        if status >= 400:
            detail = raw.decode(errors="replace")
            try:
                parsed = json.loads(detail)
                detail = parsed.get("message") or (parsed.get("error") or {}).get("message") or detail
            except (ValueError, AttributeError):
                pass
            raise EngineError(self.url, step, f"HTTP {status}: {detail}")
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = raw.decode(errors="replace")
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(self.url, step, reply.get("message", "success=false"))
        return reply

    def _exchange(self, method: str, path: str, data: bytes | None, headers: dict[str, str],
                  timeout: float) -> tuple[int, bytes]:
        """One request and its whole answer (status, body), over a connection left open by an earlier one where
        there is one, else a new one; the connection is left open for the next unless the server closes it."""
        conn = self._connection(timeout)
        try:
            conn.request(method, self._parts.path + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except BaseException:
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        else:
            with self._idle_lock:
                self._idle.append((conn, time.monotonic()))
        return resp.status, raw

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        """A connection left open within :data:`KEEP_ALIVE_S` that the server has not closed (its bound set to
        ``timeout``), else a new one (no Nagle delay: a request's small writes leave at once)."""
        now = time.monotonic()
        with self._idle_lock:
            while self._idle:
                conn, left = self._idle.pop()
                if now - left < KEEP_ALIVE_S and conn.sock is not None and not _readable(conn.sock):
                    conn.sock.settimeout(timeout)
                    return conn
                conn.close()
        parts = self._parts
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname or "", parts.port, timeout=timeout)
        conn.connect()
        if conn.sock is not None and conn.sock.family in (socket.AF_INET, socket.AF_INET6):
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def info(self, refresh: bool = False) -> EngineInfo:
        """What the engine is (each engine's adapter asks it in its own way)."""
        raise NotImplementedError

    def post(self, path: str, body: Any = None, **kw) -> Any:
        return self.request("POST", path, body if body is not None else {}, **kw)

    def get(self, path: str, **kw) -> Any:
        return self.request("GET", path, **kw)

    @property
    def tp_size(self) -> int:
        return self.info().tp_size


def _readable(sock: socket.socket) -> bool:
    """Whether a connection between requests has something to read: the server closed it (or sent what no request
    asked for); either way it is not used again. (poll, not select: a process holding many descriptors has them
    past select's 1,024.)"""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
