"""The reference engine under hostile or careless clients: bursts, idle and slow connections, chunked and
deeply nested bodies, oversized work, bad durations and versions, reads during an update, and how it is
authenticated and where it listens. One real engine (TP 1, tiny Qwen3) on loopback serves every test; a
test that needs other limits puts a second HTTP server on the same engine."""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.checks import INPUT_IDS
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.reference_engine.ranks import EngineFailure
from weightstream.reference_engine.server import EngineServer, ServerLimits, serve, stop

KEY = "k-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@contextmanager
def keyed_engine(root: Path, tp: int, seed: int) -> Iterator[EngineServer]:
    """A reference engine at TP ``tp`` on a random tiny Qwen3 (``seed``) written under ``root``, its key KEY."""
    srv = serve(save_random_checkpoint(preset_config("tiny-qwen3"), root / "m", seed=seed), tp, api_key=KEY)
    try:
        yield srv
    finally:
        stop(srv)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[EngineServer]:
    with keyed_engine(tmp_path_factory.mktemp("hardening"), 1, seed=71) as srv:
        yield srv


@contextmanager
def second_server(srv: EngineServer, limits: ServerLimits, api_key: str | None = KEY) -> Iterator[EngineServer]:
    """Another HTTP server on the same engine, with other limits."""
    other = EngineServer(srv.engine, "127.0.0.1", 0, api_key, limits)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        yield other
    finally:
        other.shutdown()
        other.server_close()
        thread.join(timeout=5)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def request(url: str, method: str, path: str, body: bytes | dict | None = None,
            headers: dict | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn = http.client.HTTPConnection("127.0.0.1", _port(url), timeout=timeout)
    try:
        conn.request(method, path, body=data, headers=AUTH if headers is None else headers)
        resp = conn.getresponse()
        raw = resp.read()
        if resp.getheader("Content-Type") != "application/json":
            return resp.status, {"text": raw.decode()}
        return resp.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


def logits(url: str) -> np.ndarray:
    status, reply = request(url, "POST", "/weightstream/logits", {"input_ids": INPUT_IDS})
    assert status == 200, reply
    return np.frombuffer(base64.b64decode(reply["logits_b64"]), dtype=np.float32).reshape(reply["shape"])


def read_to_end(sock: socket.socket, within_s: float) -> bytes:
    """Everything the server sends until it closes the connection; fails past ``within_s``."""
    sock.settimeout(within_s)
    chunks = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    raise AssertionError(f"the server kept the connection open for {within_s} s; got {b''.join(chunks)[:200]!r}")


def replies(data: bytes) -> list[tuple[int, dict]]:
    """The HTTP/1.1 responses in ``data`` (each with a Content-Length), in order."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        lengths = [int(v) for k, _, v in (x.partition(": ") for x in lines[1:]) if k.lower() == "content-length"]
        assert lengths, f"not an HTTP response with a body: {data[:300]!r}"
        length = lengths[0]
        out.append((int(lines[0].split(" ", 2)[1]), json.loads(rest[:length])))
        data = rest[length:]
    return out


# -- D5: bursts of connections ---------------------------------------------------------------------


def test_a_burst_of_200_concurrent_posts_is_answered_whole(server):
    n = 200
    barrier = threading.Barrier(n)
    statuses: list = []

    def one() -> None:
        barrier.wait(timeout=30)
        try:
            statuses.append(request(server.url, "POST", "/flush_cache", b"{}", timeout=20)[0])
        except Exception as exc:  # noqa: BLE001 — reset: the listen backlog overflowed
            statuses.append(type(exc).__name__)

    threads = [threading.Thread(target=one) for _ in range(n)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert statuses == [200] * n, {s: statuses.count(s) for s in set(statuses)}
    assert time.monotonic() - start < 20


# -- D9: idle and slow connections, a cap on connections, the token first ------------------------------


def test_idle_and_slow_connections_are_closed_and_capped(server):
    with second_server(server, ServerLimits(idle_timeout_s=1.0, max_connections=4, reserve_connections=0)) as other:
        port = _port(other.url)
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        held[1].sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthoriz")  # headers cut short
        held[2].sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                        + b"\r\nContent-Length: 100\r\n\r\n{\"input_")  # body cut short
        deadline = time.monotonic() + 5
        while other.connections_open < 4:  # all four accepted, each with its thread
            assert time.monotonic() < deadline, other.connections_open
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as fifth:
            start = time.monotonic()
            refused = read_to_end(fifth, 2.0)
        assert refused.startswith(b"HTTP/1.1 503") and time.monotonic() - start < 1.0, refused
        assert b"at most 4 connections" in refused
        start = time.monotonic()
        for sock in held:  # closed by the server once idle for 1 s
            read_to_end(sock, 3.0)
            sock.close()
        assert time.monotonic() - start < 3.0
        deadline = time.monotonic() + 2.0  # the slots are free again (each as its thread ends)
        while request(other.url, "GET", "/model_info")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_the_token_is_checked_before_a_body_is_read(server):
    with second_server(server, ServerLimits(idle_timeout_s=5.0)) as other:
        with socket.create_connection(("127.0.0.1", _port(other.url)), timeout=5) as sock:
            sock.sendall(b"POST /update_weights_from_tensor HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
                         b"Content-Length: 50000000\r\n\r\n")  # the body is never sent
            start = time.monotonic()
            ((status, reply),) = replies(read_to_end(sock, 2.0))  # answered, then closed: not left to idle
        assert status == 401 and "bearer token" in reply["error"]["message"]
        assert time.monotonic() - start < 1.0


# -- D8: chunked bodies -------------------------------------------------------------------------------


def _chunked(path: str, parts: list[bytes], extra: bytes = b"") -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return head + body + extra


def test_chunked_bodies_are_read(server):
    before = logits(server.url)
    port = _port(server.url)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # kv_cache only: the weights stay. Then a second request on the same connection.
        sock.sendall(_chunked("/release_memory_occupation", [b'{"tags":', b' ["kv_cache"]}'],
                              extra=b"GET /model_info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                    + KEY.encode() + b"\r\nConnection: close\r\n\r\n"))
        (status, released), (info_status, info) = replies(read_to_end(sock, 10.0))
    assert status == 200 and released["message"] == "released 0 bytes", released
    assert info_status == 200 and info["weight_version"] == "default"
    assert not server.engine.weights_released
    np.testing.assert_array_equal(logits(server.url), before)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # A second chunk announced that takes the body past the limit: refused before it is sent.
        sock.sendall(_chunked("/generate", [b"x" * 600_000])[:-len(b"0\r\n\r\n")] + b"%x\r\n" % 600_000)
        ((status, reply),) = replies(read_to_end(sock, 10.0))
    assert status == 413 and "exceeds the limit" in reply["message"]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nTransfer-Encoding: gzip\r\n\r\n")
        ((status, reply),) = replies(read_to_end(sock, 10.0))
    assert status == 501 and "only chunked" in reply["message"]


# -- D11: deeply nested JSON ---------------------------------------------------------------------------


def test_deeply_nested_json_is_refused_and_the_engine_keeps_serving(server):
    before = logits(server.url)
    deep_ok = {"input_ids": INPUT_IDS, "ignored": json.loads("[" * 60 + "]" * 60)}
    too_deep = {"input_ids": INPUT_IDS, "ignored": json.loads("[" * 70 + "]" * 70)}
    for body in (b"[" * 100_000, b'{"a":' * 5000, json.dumps(too_deep).encode()):
        status, reply = request(server.url, "POST", "/weightstream/logits", body)
        assert status == 400 and "nested more than 64 levels" in reply["message"], (body[:20], reply)
    assert request(server.url, "POST", "/weightstream/logits", deep_ok)[0] == 200
    np.testing.assert_array_equal(logits(server.url), before)


# -- D13: the shape of input_ids -----------------------------------------------------------------------


@pytest.mark.parametrize("path,ids,text", [
    ("/weightstream/logits", [1, 2, 3], "non-empty list of non-empty lists of token ids"),
    ("/weightstream/logits", [[1, 2], [3]], "one length"),
    ("/weightstream/logits", [[1, "2"]], "rows [0] hold something other than"),
    ("/weightstream/logits", [[]], "non-empty list of non-empty lists"),
    ("/weightstream/logits", [[[1]]], "rows [0] hold something other than"),
    ("/generate", [[1], [-2]], "rows [1] hold something other than"),
    ("/generate", [], "a non-empty list of token ids or a non-empty list"),
    ("/generate", [1, [2]], "a non-empty list of token ids or a non-empty list"),
])
def test_input_ids_of_the_wrong_shape_get_400_before_the_model(server, path, ids, text):
    status, reply = request(server.url, "POST", path, {"input_ids": ids})
    assert status == 400 and text in reply["message"], reply


def test_generate_takes_one_prompt_or_rows_of_any_length(server):
    body = {"input_ids": [[1, 2, 3], [4]], "sampling_params": {"max_new_tokens": 2}}
    status, reply = request(server.url, "POST", "/generate", body)
    assert status == 200 and [len(r["output_ids"]) for r in reply] == [2, 2]
    status, reply = request(server.url, "POST", "/generate",
                            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and len(reply["output_ids"]) == 1


# -- D7: the work of one request -----------------------------------------------------------------------


def test_work_per_request_is_bounded(server):
    long_row = [[5] * 257]
    cases = [
        ("/weightstream/logits", {"input_ids": long_row}, "max_position_embeddings (256)"),
        ("/generate", {"input_ids": [7] * 250, "sampling_params": {"max_new_tokens": 10}},
         "max_position_embeddings (256)"),
        ("/weightstream/logits", {"input_ids": [[5] * 200] * 100}, "max_batch_tokens (16384)"),
        ("/generate", {"input_ids": [[1]] * 1000, "sampling_params": {"max_new_tokens": 16}},
         "1000 rows of 17000 tokens in all"),
    ]
    for path, body, text in cases:
        start = time.monotonic()
        status, reply = request(server.url, "POST", path, body)
        assert status == 413 and text in reply["message"], reply
        assert time.monotonic() - start < 2.0
    status, reply = request(server.url, "POST", "/weightstream/logits", {"input_ids": [[5] * 256]})
    assert status == 200 and reply["shape"][:2] == [1, 256]


# -- D10: durations ------------------------------------------------------------------------------------


def test_durations_must_be_finite_and_bounded(server):
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    ipc = {"plan": "p", "num_buckets": 1, "channels": ["127.0.0.1:1"], "client": "c"}
    routes = [("/begin_weight_update", {}), ("/init_weights_update_group", group),
              ("/weightstream/update_weights_from_ipc_ahead", ipc), ("/weightstream/prepare_ipc_ahead", ipc)]
    for path, fields in routes:
        for value in ("NaN", "Infinity", "-Infinity"):
            body = json.dumps(fields)[:-1] + (", " if fields else "") + f'"timeout_s": {value}}}'
            status, reply = request(server.url, "POST", path, body.encode())
            assert status == 400 and f"{value} is not a number this engine takes" in reply["message"], reply
        for value in (1e308, -1, 0, 3601, 2**63):
            status, reply = request(server.url, "POST", path, {**fields, "timeout_s": value})
            assert status == 400 and "'timeout_s' must be seconds in (0, 3600]" in reply["message"], (path, reply)
    status, reply = request(server.url, "POST", "/init_weights_update_group", {**group, "master_port": 10**30})
    assert status == 400 and "'master_port' must be in [1, 65535]" in reply["message"]
    assert not server.engine.session_open
    with pytest.raises(EngineFailure, match="must be seconds"):
        server.engine.begin_session(float("nan"))
    # A valid bound: the watchdog gives the session up once the trainer has been silent that long.
    assert request(server.url, "POST", "/begin_weight_update", {"timeout_s": 0.5})[0] == 200
    deadline = time.monotonic() + 10
    while server.engine.session_open:
        assert time.monotonic() < deadline, "the watchdog did not end the session"
        time.sleep(0.1)


# -- D16: the weight version ---------------------------------------------------------------------------


def test_the_weight_version_is_short_printable_text(server):
    for version, text in (("v" * 257, "257 characters, more than 256"), ("v\n1", "printable"),
                          ("\ud800", "lone surrogates")):
        status, reply = request(server.url, "POST", "/update_weight_version", {"new_version": version})
        assert status == 400 and text in reply["message"], reply
    status, reply = request(server.url, "POST", "/begin_weight_update", {"pause": "x" * 300})
    assert status == 400 and "'pause' has 300 characters" in reply["message"]
    try:
        assert request(server.url, "POST", "/update_weight_version", {"new_version": "s" * 256})[0] == 200
        assert request(server.url, "GET", "/model_info")[1]["weight_version"] == "s" * 256
    finally:
        request(server.url, "POST", "/update_weight_version", {"new_version": "default"})


# -- D6: no half-applied weights served ----------------------------------------------------------------


@contextmanager
def trainer_group(url: str, name: str = "hardening") -> Iterator:
    """A weight-update group (gloo) between this process, as the trainer's rank 0, and the engine."""
    from weightstream.launch import free_port
    from weightstream.wire.groups import destroy_group, init_custom_process_group

    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo", "timeout_s": 30}
    joined = in_thread(lambda: request(url, "POST", "/init_weights_update_group", body))
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, name, 30)
    try:
        assert joined()[0] == 200
        yield group
    finally:
        request(url, "POST", "/destroy_weights_update_group", {"group_name": name})
        destroy_group(group)


def in_thread(fn):
    """Run ``fn`` in a thread (as an HTTP call that waits for this process's collective); returns a join."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()

    def join():
        thread.join(timeout=30)
        assert out, "no answer within 30 s"
        return out[0]
    return join


def test_reads_during_an_update_see_the_committed_weights_or_are_refused(server):
    import torch.distributed as dist

    url = server.url
    before = logits(url)
    hidden = preset_config("tiny-qwen3").hidden_size
    with trainer_group(url) as group:
        assert request(url, "POST", "/begin_weight_update", {"timeout_s": 60})[0] == 200
        try:
            np.testing.assert_array_equal(logits(url), before)  # opened, nothing loaded yet: the committed weights
            # One tensor of an update, broadcast by this process as a trainer would.
            loaded = in_thread(lambda: request(url, "POST", "/update_weights_from_distributed", {
                "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[hidden]],
                "group_name": "hardening"}))
            dist.broadcast(torch.full((hidden,), 3.0), group=group, group_src=0)
            assert loaded()[0] == 200
            for path, body in (("/weightstream/logits", {"input_ids": INPUT_IDS}),
                               ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})):
                status, reply = request(url, "POST", path, body)
                assert status == 409 and "not served until it is committed or aborted" in reply["message"], reply
            status, reply = request(url, "POST", "/continue_generation", {})
            assert status == 409 and "session is open" in reply["message"], reply
        finally:
            assert request(url, "POST", "/weightstream/abort_weight_update", {})[0] == 200
    np.testing.assert_array_equal(logits(url), before)
    assert request(url, "POST", "/continue_generation", {})[0] == 200


def test_p2p_buckets_told_ahead_are_checked_whole_before_anything_is_received(server):
    """Every malformed entry of ``/weightstream/update_weights_from_p2p_ahead`` named in one 400, plain or resharded
    alike; the session stays open and nothing is loaded."""
    url = server.url
    meta = {"name": "model.norm.weight", "dtype": "float32", "shape": [4], "offset": 0}
    assert request(url, "POST", "/begin_weight_update", {"timeout_s": 60})[0] == 200
    try:
        status, reply = request(url, "POST", "/weightstream/update_weights_from_p2p_ahead", {"buckets": [
            [{"src": 0, "metas": [meta], "nbytes": 16}], "x", [{"src": "0", "metas": [], "nbytes": 16, "rank": 0}]]})
        assert status == 400, reply
        assert reply["message"].endswith("bad P2P buckets: bucket 1: not a list of entries; bucket 2: entry 0: needs "
                                         "'src' (int), 'metas' (list) and 'nbytes' (int)"), reply
        status, reply = request(url, "POST", "/weightstream/update_weights_from_p2p_ahead", {"buckets": [[]]})
        assert status == 400 and reply["message"].endswith("bucket 0: 0 entries, the engine has 1 ranks"), reply
        assert server.engine.session_open and server.engine.session_loaded == 0
    finally:
        assert request(url, "POST", "/weightstream/abort_weight_update", {})[0] == 200


# -- D18: authentication and where the engine listens ----------------------------------------------------


def test_bearer_scheme_in_any_case_compared_in_constant_time(server, monkeypatch):
    import hmac

    compared = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((type(a), type(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    for header, status in ((f"bearer {KEY}", 200), (f"BEARER {KEY}", 200), (f"Bearer {KEY}", 200),
                           (f"Bearer {KEY}x", 401), (f"Basic {KEY}", 401), ("Bearer", 401), (KEY, 401)):
        got, _ = request(server.url, "GET", "/model_info", headers={"Authorization": header})
        assert got == status, header
    assert compared and all(c == (bytes, bytes) for c in compared)


def test_an_engine_without_a_key_says_so_at_start(server, capfd):
    capfd.readouterr()
    with second_server(server, ServerLimits(), api_key=None) as other:
        err = capfd.readouterr().err
        assert f"WARNING: no API key: any process that can reach {other.url}" in err
        assert request(other.url, "GET", "/model_info", headers={})[0] == 200
    with second_server(server, ServerLimits()):
        assert "no API key" not in capfd.readouterr().err


def _listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc writes them) of the TCP sockets process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                    found.append(fields[1].rsplit(":", 1)[0])
    return found


def test_workers_listen_on_loopback_only(server):
    """The engine's own store and gloo group, and a weight-update group's gloo listeners: loopback only, as
    its HTTP server (127.0.0.1)."""
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    alone = {proc.pid: _listening(proc.pid) for proc in server.engine.procs}
    with trainer_group(server.url, "listeners"):
        grouped = {proc.pid: _listening(proc.pid) for proc in server.engine.procs}
    for pid, addresses in alone.items():
        assert addresses and set(addresses) <= loopback, (pid, addresses)
        assert len(grouped[pid]) > len(addresses) and set(grouped[pid]) <= loopback, (pid, grouped[pid])


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from weightstream.cli import UsageError, build_parser, engine_api_key

    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.delenv("WEIGHTSTREAM_API_KEY", raising=False)
    args = build_parser().parse_args(["engine", "--hf", "m", "--api-key-file", str(key_file)])
    assert engine_api_key(args) == "from-file"
    assert engine_api_key(build_parser().parse_args(["engine", "--hf", "m"])) is None
    monkeypatch.setenv("WEIGHTSTREAM_API_KEY", "from-env")
    assert engine_api_key(build_parser().parse_args(["engine", "--hf", "m"])) == "from-env"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--hf", "m", "--api-key", "a", "--api-key-file", str(key_file)])
    key_file.write_text("\n")
    with pytest.raises(UsageError, match="empty"):
        engine_api_key(build_parser().parse_args(["engine", "--hf", "m", "--api-key-file", str(key_file)]))
