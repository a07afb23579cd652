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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from weightstream.engines.base import EngineError, EngineInfo, EngineUnreachable
from weightstream.engines.formats import stated_format
from weightstream.wire.fp8 import BlockFP8

__all__ = ["KEEP_ALIVE_S", "HTTPEngine", "PendingReply"]

# How long a connection left open after a request is used again: well within the idle bound of the servers an
# engine runs (uvicorn closes after 5 s idle, our engine after 30 s), so that a request never goes out on a
# connection the server is closing; an update's requests follow each other within milliseconds.
KEEP_ALIVE_S = 2.0

T = TypeVar("T")


def _as_is(reply: Any) -> Any:
    return reply


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
        """One request and its answer (the JSON it decodes to): :class:`EngineUnreachable` where no answer comes
        within ``timeout_s`` (default: this engine's), :class:`EngineError` where the engine refuses it."""
        return self.start(method, path, body, step=step, timeout_s=timeout_s).result()

    def start(self, method: str, path: str, body: Any = None, *, step: str | None = None,
              timeout_s: float | None = None, then: Callable[[Any], T] = _as_is) -> PendingReply[T]:
        """Send a request now and return with its answer unread (:class:`PendingReply`: what :meth:`request` would
        have returned, given to ``then``): the caller goes on while the engine works, and no thread waits."""
        step = step or path.strip("/")
        timeout = timeout_s or self.timeout_s
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn = self._connection(timeout)
            try:
                conn.request(method, self._parts.path + path, body=data, headers=headers)
            except BaseException:
                conn.close()
                raise
        except (OSError, http.client.HTTPException) as exc:
            raise self._unreachable(step, timeout, exc) from None
        return PendingReply(self, conn, step, timeout, then)

    def _unreachable(self, step: str, timeout: float, exc: BaseException) -> EngineUnreachable:
        return EngineUnreachable(self.url, step, f"unreachable or no answer within {timeout:g} s ({exc})")

    def _answer(self, status: int, raw: bytes, step: str) -> Any:
        """An answer's body as its JSON (text where it is not JSON); :class:`EngineError` for an HTTP error or a
        reply that says ``success: false``."""
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

    def _left(self, conn: http.client.HTTPConnection, will_close: bool) -> None:
        """A connection whose answer was read whole: open for the next request, unless the server closes it."""
        if will_close:
            conn.close()
            return
        with self._idle_lock:
            self._idle.append((conn, time.monotonic()))

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


def _readable(sock: socket.socket, wait_s: float = 0.0) -> bool:
    """Whether a connection has something to read (within ``wait_s``): between requests, the server closed it (or
    sent what no request asked for), and it is not used again; after one, its answer came. (poll, not select: a
    process holding many descriptors has them past select's 1,024.)"""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(int(wait_s * 1000)))


class PendingReply(Generic[T]):
    """A request sent whose answer is not read yet (:meth:`HTTPEngine.start`). :meth:`result` reads it once, on the
    thread that calls it, and returns what :meth:`HTTPEngine.request` would have (given to ``then``), or raises what
    it would have; later calls give the same. :meth:`ready` says, without reading, whether it has come."""

    def __init__(self, engine: HTTPEngine, conn: http.client.HTTPConnection, step: str, timeout: float,
                 then: Callable[[Any], T]):
        self._engine, self._conn, self._step, self._timeout, self._then = engine, conn, step, timeout, then
        self._outcome: tuple[T] | Exception | None = None

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether the answer has come (or the connection ended), waiting at most ``wait_s`` for it: then
        :meth:`result` does not wait."""
        sock = self._conn.sock
        return self._outcome is not None or sock is None or _readable(sock, wait_s)

    def result(self, timeout_s: float | None = None) -> T:
        """The answer, waiting at most ``timeout_s`` for it (default: the request's bound)."""
        if self._outcome is None:
            self._outcome = self._read(self._timeout if timeout_s is None else timeout_s)
        if isinstance(self._outcome, Exception):
            raise self._outcome
        return self._outcome[0]

    def abandon(self) -> None:
        """The answer will not be read: the connection closes (the engine sees its client gone)."""
        if self._outcome is None:
            self._conn.close()
            self._outcome = self._engine._unreachable(self._step, self._timeout, ConnectionError("abandoned"))

    def _read(self, timeout: float) -> tuple[T] | Exception:
        conn = self._conn
        try:
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            return self._engine._unreachable(self._step, timeout, exc)
        except BaseException:
            conn.close()
            raise
        self._engine._left(conn, resp.will_close)
        try:
            return (self._then(self._engine._answer(resp.status, raw, self._step)),)
        except Exception as exc:  # noqa: BLE001 -- raised by result(), now and on every later call
            return exc
