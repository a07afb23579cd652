"""The reference engine's server and its workers never take one request's answer for another's, and the engine
bounds what one request may hold of it in time: the work of a /generate request, and the reading of a request
however slowly its client sends it, with /health answered while slow clients hold every connection. One real
engine (TP 2, tiny Qwen3) on loopback serves the tests that need one; a test that needs other limits puts a
second HTTP server on the same engine."""

from __future__ import annotations

import base64
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import numpy as np
import pytest

from tests.helpers.checks import INPUT_IDS
from tests.test_engine_hardening import KEY, _port, keyed_engine, read_to_end, request, second_server
from weightstream.common.http_server import BoundedReads, RequestReadTimeout
from weightstream.reference_engine.server import EngineServer, ServerLimits

OTHER_IDS = [[row[-1 - i] for i in range(len(row))] for row in INPUT_IDS]  # the same tokens, reversed


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[EngineServer]:
    with keyed_engine(tmp_path_factory.mktemp("protocol"), 2, seed=73) as srv:
        yield srv


def logits_of(url: str, ids: list[list[int]]) -> np.ndarray:
    status, reply = request(url, "POST", "/weightstream/logits", {"input_ids": ids})
    assert status == 200, reply
    return np.frombuffer(base64.b64decode(reply["logits_b64"]), dtype=np.float32).reshape(reply["shape"])


def generated(url: str, ids: list[int], n: int) -> list[int]:
    status, reply = request(url, "POST", "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n}})
    assert status == 200, reply
    return reply["output_ids"]


def wait_until(condition: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {within_s} s"
        time.sleep(0.05)


# -- one answer per request ----------------------------------------------------------------------------


def test_a_command_given_up_on_never_answers_a_later_request(server, capfd):
    """The workers are stalled (stopped, as a machine under memory pressure or a debugger holds them) while they
    are asked to join a weight-update group; the server gives them up at ``timeout_s`` + 5 s. Until they answer,
    /health says why and every request is refused at once; once they run again their late answers (the group
    cannot form: its store accepts and never answers, which the worker refuses within its bound) are dropped,
    and each later request gets its own answer."""
    url = server.url
    fresh_a, fresh_b = logits_of(url, INPUT_IDS), logits_of(url, OTHER_IDS)
    assert not np.array_equal(fresh_a, fresh_b)
    fresh_tokens = generated(url, INPUT_IDS[0], 4)
    silent = socket.create_server(("127.0.0.1", 0), backlog=8)  # accepts (the kernel's backlog), never answers
    group = {"master_address": "127.0.0.1", "master_port": silent.getsockname()[1], "rank_offset": 1,
             "world_size": 3, "group_name": "never", "backend": "gloo", "timeout_s": 1}
    workers = [proc.pid for proc in server.engine.procs]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        status, reply = request(url, "POST", "/init_weights_update_group", group, timeout=60)
        assert status == 400 and "did not answer init_group within 6 s" in reply["message"], reply
        assert time.monotonic() - start < 15
        status, reply = request(url, "GET", "/health")
        assert status == 503 and "have not answered init_group" in reply["message"], reply
        assert "restart it if they never do" in reply["message"]
        start = time.monotonic()
        status, reply = request(url, "POST", "/weightstream/logits", {"input_ids": INPUT_IDS})
        assert status == 503 and "have not answered init_group" in reply["message"], reply
        assert time.monotonic() - start < 2.0  # refused at once: nothing was sent to the workers
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)  # they run again: the group cannot form, and they answer, late
    wait_until(lambda: request(url, "GET", "/health")[0] == 200, 30, "healthy again once the workers answered")
    for _ in range(3):
        np.testing.assert_array_equal(logits_of(url, OTHER_IDS), fresh_b)
        np.testing.assert_array_equal(logits_of(url, INPUT_IDS), fresh_a)
    assert generated(url, INPUT_IDS[0], 4) == fresh_tokens
    silent.close()
    assert server.engine.unanswered == [None, None]
    err = capfd.readouterr().err
    assert err.count("past its bound: the reply was dropped") == 2, err  # one late reply per rank, logged


# -- the time one /generate request may take -----------------------------------------------------------


def test_generate_past_the_time_bound_is_stopped_and_refused_naming_it(server):
    url = server.url
    fresh = logits_of(url, INPUT_IDS)
    small = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
    expected = generated(url, [5, 6, 7], 4)
    with second_server(server, ServerLimits(max_request_s=0.5)) as bounded:
        big = {"input_ids": [[7] * 8] * 16, "sampling_params": {"max_new_tokens": 240}}  # within the token bounds
        start = time.monotonic()
        status, reply = request(bounded.url, "POST", "/generate", big)
        took = time.monotonic() - start
        assert status == 413, reply
        message = reply["message"]
        assert "/generate ran past 0.5 s" in message and "max_request_s" in message, message
        assert "--max-request-seconds" in message and "stopped in row" in message, message
        assert took < 5.0, took  # every rank stopped between two decode steps, at the same one
        assert request(url, "GET", "/health")[0] == 200
        status, reply = request(bounded.url, "POST", "/generate", small)
        assert status == 200 and reply["output_ids"] == expected, reply
    np.testing.assert_array_equal(logits_of(url, INPUT_IDS), fresh)


# -- reading a request ---------------------------------------------------------------------------------


def trickle(sock: socket.socket, head: bytes, every_s: float, give_up_s: float) -> tuple[bytes, float]:
    """Send ``head``, then one byte every ``every_s``, until the server closes the connection; returns what it
    sent and how long after ``head`` it closed."""
    sock.sendall(head)
    start = time.monotonic()
    sock.settimeout(every_s)
    got = b""
    while time.monotonic() - start < give_up_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            try:
                sock.sendall(b"a")
            except OSError:  # closed meanwhile: what it sent is read next
                pass
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return got, time.monotonic() - start
        got += chunk
    raise AssertionError(f"the server kept a client sending a byte every {every_s} s for {give_up_s} s")


@pytest.mark.parametrize("head", [
    b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: ",  # its headers, one byte at a time
    b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    + b"\r\nContent-Length: 1000\r\n\r\n",  # its body, one byte at a time
], ids=["headers", "body"])
def test_a_client_that_trickles_its_request_is_cut_at_the_request_deadline(server, head):
    with second_server(server, ServerLimits(request_read_s=2.0, idle_timeout_s=5.0)) as other:
        with socket.create_connection(("127.0.0.1", _port(other.url)), timeout=10) as sock:
            got, closed_after = trickle(sock, head, 0.5, give_up_s=10.0)
    assert got.startswith(b"HTTP/1.1 408 Request Timeout"), got
    assert b"did not arrive whole within 2 s" in got and b"request_read_s" in got, got
    assert 1.8 <= closed_after < 4.0, closed_after


def test_health_answers_while_slow_clients_hold_every_connection(server):
    limits = ServerLimits(max_connections=6, reserve_connections=2, reserve_read_s=1.0, request_read_s=60.0,
                          idle_timeout_s=60.0)
    with second_server(server, limits) as other, ExitStack() as stack:
        port = _port(other.url)
        for _ in range(6):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # and nothing more
        wait_until(lambda: request(other.url, "GET", "/model_info")[0] == 503, 10, "every connection held")
        for _ in range(5):
            start = time.monotonic()
            status, reply = request(other.url, "GET", "/health", headers={})
            assert status == 200 and time.monotonic() - start < 1.0, (status, reply)
        status, reply = request(other.url, "GET", "/model_info")
        assert status == 503 and "at most 6 connections" in reply["message"], reply
        assert "GET /health is still answered" in reply["message"]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:  # a reserve slot, nothing sent
            start = time.monotonic()
            refused = read_to_end(idle, 3.0)
        assert refused.startswith(b"HTTP/1.1 503") and time.monotonic() - start < 2.0, refused
    assert request(server.url, "GET", "/health")[0] == 200


# -- in process ----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_reads_stop_at_the_request_deadline_however_the_bytes_trickle():
    ours, theirs = socket.socketpair()
    stop_sending = threading.Event()

    def send() -> None:
        while not stop_sending.wait(0.05):
            theirs.sendall(b"x")

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        reads = BoundedReads(ours, idle_s=5.0)
        reads.deadline = time.monotonic() + 0.3
        start = time.monotonic()
        with pytest.raises(RequestReadTimeout):
            while True:
                reads.readinto(bytearray(16))
        assert 0.29 <= time.monotonic() - start < 0.6
        assert ours.gettimeout() == 5.0  # what bounds the connection's writes is left as it was
    finally:
        stop_sending.set()
        sender.join(timeout=2)
        ours.close()
        theirs.close()


@pytest.mark.unit
def test_server_limits_list_every_problem():
    with pytest.raises(ValueError) as exc:
        ServerLimits(max_request_s=0, request_read_s=float("nan"), max_connections=0, reserve_connections=-1)
    text = str(exc.value)
    for name in ("max_request_s", "request_read_s", "max_connections", "reserve_connections"):
        assert name in text, text


@pytest.mark.unit
def test_the_engine_command_takes_the_time_bound_in_seconds(capsys):
    from weightstream.cli import build_parser

    args = build_parser().parse_args(["engine", "--hf", "m", "--max-request-seconds", "2.5"])
    assert args.max_request_seconds == 2.5
    for bad in ("0", "-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["engine", "--hf", "m", f"--max-request-seconds={bad}"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: argument --max-request-seconds"), err


def test_a_store_that_takes_the_connection_and_never_answers_is_refused_within_its_bound():
    """torch's TCPStore client waits without a bound for a peer that accepted its connection; weightstream's
    refuses it at its timeout (and a store that does answer still serves)."""
    from weightstream.wire.groups import STORE_ANSWER_GRACE_S, tcp_store

    silent = socket.create_server(("127.0.0.1", 0), backlog=8)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="took the connection but gave no answer within 1 s"):
            tcp_store("127.0.0.1", silent.getsockname()[1], is_master=False, world_size=2, timeout=1.0)
        assert time.monotonic() - start < 1.0 + STORE_ANSWER_GRACE_S + 1.0
    finally:
        silent.close()
    host = tcp_store("127.0.0.1", 0, is_master=True, world_size=2, timeout=5.0)
    client = tcp_store("127.0.0.1", host.port, is_master=False, world_size=2, timeout=5.0)
    client.set("k", "v")
    assert host.get("k") == b"v"
