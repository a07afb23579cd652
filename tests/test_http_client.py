"""The engines' HTTP client (weightstream.engines.http.HTTPEngine) keeps its connections between requests: against a
real server (weightstream.common.http_server.JsonHttpServer, in this process), a request goes over the connection the
last one left open, never over one the server closed; a server that stops closes the connections kept open to it,
so a server started again on the same port answers the next request; and a process holding more than select()'s
1,024 descriptors reuses its connections too. A request started (``HTTPEngine.start``) is sent at once and answered
when read, on the caller's thread: once, the same answer (or the same refusal) every time asked."""

from __future__ import annotations

import os
import threading

import pytest

from weightstream.common.http_server import HttpLimits, JsonHttpServer
from weightstream.engines.base import EngineError, EngineUnreachable
from weightstream.engines.http import HTTPEngine

pytestmark = pytest.mark.unit  # in-process servers: the fast subset


def _server(port: int, name: str) -> JsonHttpServer:
    server = JsonHttpServer(("127.0.0.1", port), HttpLimits())
    server.routes[("GET", "/who")] = lambda r: (200, {"name": name, "connections": server.connections_open})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _stop(server: JsonHttpServer) -> None:
    server.shutdown()
    server.server_close()


def test_requests_reuse_one_connection_and_a_restarted_server_answers():
    first = _server(0, "first")
    port = first.server_address[1]
    client = HTTPEngine(f"http://127.0.0.1:{port}", timeout_s=5)
    try:
        answers = [client.get("/who") for _ in range(5)]
        assert [a["name"] for a in answers] == ["first"] * 5
        assert {a["connections"] for a in answers} == {1}  # the same connection, kept open, each time
    finally:
        _stop(first)
    second = _server(port, "second")  # the same port, while the client still holds its connection to the first
    try:
        assert client.get("/who")["name"] == "second"
    finally:
        _stop(second)


def test_connections_are_reused_past_select_descriptor_limit():
    server = _server(0, "many")
    spare = [os.dup(0) for _ in range(1100)]  # the client's socket gets a descriptor above 1,024
    try:
        client = HTTPEngine(f"{server.url}", timeout_s=5)
        assert [client.get("/who")["connections"] for _ in range(3)] == [1, 1, 1]
    finally:
        for fd in spare:
            os.close(fd)
        _stop(server)


def _held_server() -> tuple[JsonHttpServer, threading.Event, threading.Event]:
    """A server whose ``/held`` route says when a request came, then answers only once let go (what it answers:
    the body's ``x`` doubled; a body with ``refuse`` is refused, 400)."""
    server = _server(0, "held")
    came, go = threading.Event(), threading.Event()

    def held(body: dict):
        came.set()
        go.wait(10)
        if body.get("refuse"):
            return 400, {"success": False, "message": f"refused {body['x']}"}
        return 200, {"doubled": 2 * body["x"], "connections": server.connections_open}

    server.routes[("POST", "/held")] = held
    return server, came, go


def test_a_started_request_is_sent_at_once_and_its_answer_read_once_when_asked():
    server, came, go = _held_server()
    client = HTTPEngine(server.url, timeout_s=5)
    try:
        pending = client.start("POST", "/held", {"x": 21}, then=lambda reply: reply["doubled"])
        assert came.wait(5)  # the engine has the request while the caller goes on, no thread of ours waiting
        assert not pending.ready()
        go.set()
        assert pending.ready(5.0)
        assert pending.result() == 42 and pending.result() == 42
        assert client.get("/who")["connections"] == 1  # its connection, read whole, was kept for the next request
    finally:
        _stop(server)


def test_a_started_request_refused_raises_the_same_refusal_each_time_and_an_abandoned_one_closes():
    server, came, go = _held_server()
    client = HTTPEngine(server.url, timeout_s=5)
    go.set()
    try:
        refused = client.start("POST", "/held", {"x": 3, "refuse": True})
        for _ in range(2):
            with pytest.raises(EngineError, match="HTTP 400: refused 3"):
                refused.result()
        go.clear()
        late = client.start("POST", "/held", {"x": 4})
        assert came.wait(5)
        with pytest.raises(EngineUnreachable, match=r"no answer within 0\.2 s"):
            late.result(0.2)  # no answer within its bound: the connection is closed, not used again
        abandoned = client.start("POST", "/held", {"x": 5})
        abandoned.abandon()
        with pytest.raises(EngineUnreachable, match="abandoned"):
            abandoned.result()
        go.set()
        assert client.post("/held", {"x": 6})["doubled"] == 12
    finally:
        go.set()
        _stop(server)
