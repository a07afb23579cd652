"""The engines' HTTP client (weightstream.engines.http.HTTPEngine) keeps its connections between requests: against a
real server (weightstream.common.http_server.JsonHttpServer, in this process), a request goes over the connection the
last one left open, never over one the server closed; a server that stops closes the connections kept open to it,
so a server started again on the same port answers the next request; and a process holding more than select()'s
1,024 descriptors reuses its connections too."""

from __future__ import annotations

import os
import threading

import pytest

from weightstream.common.http_server import HttpLimits, JsonHttpServer
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
