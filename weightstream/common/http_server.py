"""A small bounded JSON HTTP server: the face weightstream's engine serves its routes on.

:class:`JsonHttpServer` runs one thread per connection, at most ``max_connections`` of them, and a few more in
reserve that answer only its health route; a route takes the request its body decodes into
(:meth:`JsonHttpServer.decode`) and answers ``(status, reply)``, the reply JSON (or text). What a client may hold
or send is bounded (:class:`HttpLimits`): each request's line, headers and body arrive within one deadline however
slowly they trickle, a body is at most a route's limit (``Content-Length`` or chunked), a JSON body is an object of
finite numbers nested at most :data:`MAX_JSON_DEPTH` deep, and a bearer token, where the server has one, is checked
before any body is read. Every refusal is one answer naming its bound (docs/engines.md, "Bounds")."""

from __future__ import annotations

import hmac
import io
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "MAX_BODY_BYTES", "MAX_JSON_DEPTH", "SHUTDOWN_POLL_S", "HttpLimits", "BadRequest", "bearer_matches",
    "announces_body", "read_chunked", "nesting_exceeds", "parse_body", "error_reply", "RequestReadTimeout",
    "BoundedReads", "raw_reply", "Route", "JsonHandler", "ReserveHandler", "JsonHttpServer",
]

MAX_BODY_BYTES = 64 << 20
MAX_JSON_DEPTH = 64  # lists and objects nested in a request body
# How often the accepting loop looks whether it is to stop: socketserver's 0.5 s would be a tenth of the 5 s an
# engine has to stop in, spent idle.
SHUTDOWN_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client may hold of the HTTP server, or send it in one request."""

    max_body_bytes: int = MAX_BODY_BYTES  # a body of a bulk route (:class:`JsonHttpServer`'s ``bulk_routes``)
    max_small_body_bytes: int = 1 << 20  # a body of any other route
    max_connections: int = 512  # open at once; more go to the reserve (below), past it answered 503 and closed
    idle_timeout_s: float = 30.0  # a client that sends nothing (or stops mid-request) this long is disconnected
    listen_backlog: int = 1024  # connections the kernel queues until the server accepts them (bursts)
    request_read_s: float = 60.0  # one request's line, headers and body must all arrive within this
    reserve_connections: int = 16  # past max_connections, read for the health route only (others: 503)
    reserve_read_s: float = 2.0  # the whole-request bound on those

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("bad server limits: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every value out of its range (a record that extends these limits adds its own)."""
        problems = [f"{name} must be a positive number of seconds, got {value!r}" for name, value in (
            ("idle_timeout_s", self.idle_timeout_s), ("request_read_s", self.request_read_s),
            ("reserve_read_s", self.reserve_read_s)) if not 0 < value < float("inf")]
        problems += [f"{name} must be a positive integer, got {value!r}" for name, value in (
            ("max_body_bytes", self.max_body_bytes), ("max_small_body_bytes", self.max_small_body_bytes),
            ("max_connections", self.max_connections), ("listen_backlog", self.listen_backlog)) if not value > 0]
        if self.reserve_connections < 0:
            problems.append(f"reserve_connections must be 0 or more, got {self.reserve_connections!r}")
        return problems


class BadRequest(Exception):
    """A request refused as it stands (4xx; 5xx where the server cannot take it now), before anything runs."""

    def __init__(self, status: int, message: str):
        self.status, self.message = HTTPStatus(status), message
        super().__init__(message)


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


def nesting_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON ``value`` nests lists and objects more than ``limit`` deep (walked without
    recursion)."""
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return False


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number this engine takes (finite numbers only)")


def parse_body(raw: bytes) -> dict:
    """A request's body: a JSON object of finite numbers, nested at most :data:`MAX_JSON_DEPTH` levels."""
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


def error_reply(exc: BadRequest) -> dict:
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


# A route: the request its body decoded into -> (HTTP status, reply: what JSON encodes, or text).
Route = Callable[[Any], tuple[int, Any]]


class JsonHandler(BaseHTTPRequestHandler):
    """One connection of the ``max_connections``: requests one after another (keep-alive)."""

    server: JsonHttpServer
    protocol_version = "HTTP/1.1"
    # A reply's headers and body leave in one write when the request is done (the handler flushes then); written
    # apart, on a kept-alive connection the body would wait for the client's delayed acknowledgement of the
    # headers (Nagle's algorithm): 40 ms per request.
    wbufsize = 1 << 16
    _unread = False  # the request announced a body that has not been read (whole) yet
    reserve = False  # a connection past max_connections (:class:`ReserveHandler`)

    def setup(self) -> None:
        limits = self.server.limits
        # bounds every write on this connection; typeshed declares timeout a ClassVar, but
        # StreamRequestHandler.setup reads it from the instance, so a per-connection value is what it takes
        self.timeout = limits.reserve_read_s if self.reserve else limits.idle_timeout_s  # type: ignore[misc]
        super().setup()
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile.close()  # the socket's own reader: each read is bounded by the request's deadline instead
        self.reads = BoundedReads(self.connection, self.timeout)
        self.buffered = io.BufferedReader(self.reads)
        self.rfile = self.buffered

    def handle_one_request(self) -> None:
        """One request: the client may keep the connection idle ``idle_timeout_s`` before its first byte; from
        that byte on, its line, headers and body must all arrive within ``request_read_s`` (else 408, closed)."""
        limits = self.server.limits
        self.reads.deadline = None
        if not self.server.waiting(self.connection, True):  # the server is closing: no request more
            self.close_connection = True
            return
        try:
            if not self.buffered.peek(1):  # the client closed the connection (or the server, closing)
                self.close_connection = True
                return
        except TimeoutError:
            self.close_connection = True
            if self.reserve:
                raw_reply(self.connection, HTTPStatus.SERVICE_UNAVAILABLE, self.server.busy_message())
            return
        finally:
            self.server.waiting(self.connection, False)
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
        """``body``: text (sent as such) or what JSON encodes."""
        text = isinstance(body, str)
        data = body.encode() if text else json.dumps(body).encode()
        if self._unread or self.server.closing:  # what follows is the rest of a body; or the server is closing
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
        if not key or self.path == self.server.health_path:
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

    def _route(self, method: str, path: str) -> Route:
        route = self.server.routes.get((method, path))
        if route is not None:
            return route
        allowed = [m for (m, p) in self.server.routes if p == path]
        if allowed:
            raise BadRequest(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {', '.join(allowed)}, not {method}")
        raise BadRequest(HTTPStatus.NOT_FOUND, f"no route {method} {path}")

    def _dispatch(self, method: str) -> None:
        """Refused before any body is read: past ``max_connections``, anything but the health route (503); without
        the bearer token (401). Then the route's request decoded and run; whatever it raises is answered
        (:meth:`JsonHttpServer.failure`)."""
        self._unread = announces_body(self.headers)
        path = self.path.split("?", 1)[0]
        if self.reserve:  # past max_connections: GET of the health route only, then closed
            self.close_connection = True
            if (method, path) != ("GET", self.server.health_path):
                exc = BadRequest(HTTPStatus.SERVICE_UNAVAILABLE, self.server.busy_message())
                self._reply(exc.status, error_reply(exc))
                return
        if not self._authorised():  # before any body is read
            return
        try:
            route = self._route(method, path)
            request = self.server.decode(path, self._body(path) if method == "POST" else {})
        except BadRequest as exc:
            self._reply(exc.status, error_reply(exc))
            return
        try:
            status, reply = route(request)
        except Exception as exc:  # noqa: BLE001 — never drop a connection without an answer
            status, reply = self.server.failure(exc)
        self._reply(status, reply)


class ReserveHandler(JsonHandler):
    """A connection past ``max_connections``: its one request read within ``reserve_read_s``, answered if it is
    a GET of the health route (503 otherwise), and the connection closed."""

    reserve = True


class JsonHttpServer(ThreadingHTTPServer):
    """Serves :attr:`routes` (``(method, path) -> route``) under ``limits``: one thread per connection, at most
    ``limits.max_connections`` of them. ``api_key``: the bearer token every route but ``health_path`` takes
    (None: none); ``bulk_routes``: the paths whose bodies may be up to ``max_body_bytes`` (any other's:
    ``max_small_body_bytes``). A server built on it overrides :meth:`decode` (a route's typed request),
    :meth:`failure` (what a route's error answers), :meth:`stopping` and :meth:`log`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], limits: HttpLimits, api_key: str | None = None, *,
                 bulk_routes: frozenset[str] = frozenset(), health_path: str = "/health"):
        self.request_queue_size = limits.listen_backlog  # the listen() backlog, set as the socket is bound
        super().__init__(address, JsonHandler)
        self.api_key, self.limits, self.bulk_routes, self.health_path = api_key, limits, bulk_routes, health_path
        self.routes: dict[tuple[str, str], Route] = {}
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        self.reserve = threading.BoundedSemaphore(limits.reserve_connections)  # past slots: the health route only
        self.connections_open = 0  # connections with a thread of their own now (slots and reserve)
        self._counting = threading.Lock()
        # Kept-alive connections waiting for their next request: closed when the server closes (a client holding one
        # then sees it closed, instead of asking a server that is gone, or another on the same port, through it).
        self._waiting: set[socket.socket] = set()
        self.closing = False

    def waiting(self, conn: socket.socket, idle: bool) -> bool:
        """``conn`` waits for its next request (``idle``) or has one; False where the server is closing."""
        with self._counting:
            if idle and not self.closing:
                self._waiting.add(conn)
            else:
                self._waiting.discard(conn)
            return not self.closing

    def server_close(self) -> None:
        """Stop listening, and close every kept-alive connection that waits for a request (one with a request
        answers it, and is closed then)."""
        with self._counting:
            self.closing = True
            waiting, self._waiting = self._waiting, set()
        super().server_close()
        for conn in waiting:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def decode(self, path: str, body: dict) -> Any:
        """What ``path``'s route runs on, from its parsed ``body`` (a GET's: empty); a body refused raises one
        :class:`BadRequest`. Here: the body itself."""
        return body

    def failure(self, exc: Exception) -> tuple[int, Any]:
        """The answer to a route that raised ``exc``: a :class:`BadRequest`'s status and message; else 500."""
        if isinstance(exc, BadRequest):
            return exc.status, error_reply(exc)
        return HTTPStatus.INTERNAL_SERVER_ERROR, {"success": False, "message": f"{type(exc).__name__}: {exc}"}

    def serve_forever(self, poll_interval: float = SHUTDOWN_POLL_S) -> None:
        """Serve until :meth:`shutdown`, which the loop sees when it next polls: every :data:`SHUTDOWN_POLL_S`."""
        super().serve_forever(poll_interval)

    def stopping(self) -> bool:
        """Whether the server is being shut down (a request cut then is not reported)."""
        return False

    def log(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def handle_error(self, request, client_address) -> None:
        """A client that went away (or a request cut by shutdown) is not worth a traceback."""
        exc = sys.exc_info()[1]
        if self.stopping() or isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        self.log(f"request from {client_address[0]}:{client_address[1]} failed: {type(exc).__name__}: {exc}")

    def body_limit(self, path: str) -> int:
        return self.limits.max_body_bytes if path in self.bulk_routes else self.limits.max_small_body_bytes

    # A TCP server's request is its connection's socket: typeshed types every server's as a TCP or a UDP one.
    def process_request(self, request: socket.socket, client_address) -> None:  # type: ignore[override]
        """A thread for the connection: one of ``max_connections``, else one of ``reserve_connections`` (it may
        ask for the health route only, so that slow or idle clients holding every connection do not make the
        server look down); past both it is answered 503 and closed at once, here in the accepting thread."""
        if self.slots.acquire(blocking=False):
            handler, slots = JsonHandler, self.slots
        elif self.reserve.acquire(blocking=False):
            handler, slots = ReserveHandler, self.reserve
        else:
            raw_reply(request, HTTPStatus.SERVICE_UNAVAILABLE, self.busy_message())
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self._serve_connection, args=(request, client_address, handler, slots),
                                  name="weightstream-http-connection", daemon=True)
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

    def _serve_connection(self, request: socket.socket, client_address, handler: type[JsonHandler],
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
        return (f"this engine serves at most {self.limits.max_connections} connections at once (GET "
                f"{self.health_path} is still answered); try again")

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if isinstance(host, (bytes, bytearray)):  # typed as any address bind() takes; bound, it is text
            host = host.decode()
        return f"http://{host}:{port}"
