"""``weightstream engine`` as a service: it stops within 5 s of SIGTERM or SIGINT — idle, right after
an IPC or a broadcast update, or with an update in flight — leaving no worker process, shared-memory
file or port behind; and bad requests get a clear 4xx while it keeps serving its committed weights."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.workers import INPUT_IDS, Case, run_timed_updates
from tests.test_update import SMALL, engine
from weightstream.engines import ReferenceEngine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _mapped_inodes() -> set[int]:
    """The inodes of /dev/shm files some live process maps (a named semaphore or shared memory in use)."""
    inodes: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                inodes |= {int(line.split()[4]) for line in f if "/dev/shm/" in line}
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return inodes


def _left_behind(before: set[str]) -> set[str]:
    """/dev/shm entries made since ``before`` that no live process holds and that are still there a second later:
    what the stopped engine left. Entries of processes still running (another suite's, say) are theirs, and one
    between its owner's close and unlink is gone a moment later: neither is a leak."""
    first = _unheld(before)
    if not first:
        return first
    time.sleep(1.0)
    return first & _unheld(before)


def _unheld(before: set[str]) -> set[str]:
    """/dev/shm entries made since ``before`` that no live process maps now."""
    held = _mapped_inodes()
    left = set()
    for name in _shm() - before:
        try:
            if os.stat(f"/dev/shm/{name}").st_ino not in held:
                left.add(name)
        except FileNotFoundError:  # removed by its owner meanwhile
            continue
    return left


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Service:
    """``weightstream engine`` in its own process, as users run it; ``fault``: one of
    :mod:`tests.helpers.faults`'s, injected into its workers."""

    def __init__(self, model_dir: str, tp: int, fault: str | None = None):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        entry = ["tests.helpers.faults", fault] if fault else ["weightstream.cli"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *entry, "engine", "--hf", model_dir, "--tp", str(tp), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        line = self.proc.stdout.readline()
        assert "serving on" in line, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.url = line.rsplit(" ", 1)[-1].strip()
        self.port = int(self.url.rsplit(":", 1)[-1])
        info = ReferenceEngine(self.url).server_info()
        self.workers = info["worker_pids"]
        assert len(self.workers) == tp and all(_alive(p) for p in self.workers)

    def stop(self, signum: int) -> float:
        """Send ``signum``; the seconds until the engine's process has exited."""
        start = time.monotonic()
        self.proc.send_signal(signum)
        self.proc.wait(timeout=30)
        return time.monotonic() - start

    def assert_clean(self) -> None:
        assert self.proc.returncode == 0, self.proc.stderr.read()[-3000:]
        deadline = time.monotonic() + 2  # orphans would be re-parented and live on; the dead are reaped
        while any(_alive(p) for p in self.workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in self.workers), "worker processes outlived the engine"
        assert _port_free(self.port)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cfg = preset_config("tiny-qwen3")
    root = tmp_path_factory.mktemp("service")
    return save_random_checkpoint(cfg, root / "src", seed=51), save_random_checkpoint(cfg, root / "eng", seed=52)


def test_sigterm_idle_tp2(dirs):
    shm = _shm()
    svc = Service(dirs[1], tp=2)
    seconds = svc.stop(signal.SIGTERM)
    assert seconds <= 5.0, seconds
    svc.assert_clean()
    assert not _left_behind(shm), _left_behind(shm)


@pytest.mark.parametrize("transport,signum", [("ipc", signal.SIGINT), ("broadcast", signal.SIGTERM)])
def test_signal_right_after_an_update(dirs, transport, signum):
    src, eng_dir = dirs
    shm = _shm()
    svc = Service(eng_dir, tp=1)
    (result,) = launch(1, run_timed_updates, Case(src, Layout(1, 1)),
                       [([svc.url], {"transport": transport, "bucket_bytes": SMALL, "checksums": True})])
    assert result[0]["report"].transport == transport
    assert_logits_close(ReferenceEngine(svc.url).logits(INPUT_IDS), hf_logits(src, INPUT_IDS))
    seconds = svc.stop(signum)
    assert seconds <= 5.0, seconds
    svc.assert_clean()
    assert not _left_behind(shm), _left_behind(shm)


def test_sigterm_with_an_update_in_flight(dirs):
    src, eng_dir = dirs
    shm = _shm()
    svc = Service(eng_dir, tp=2, fault="stall@1")  # bucket 0 loaded, the workers stuck in bucket 1
    results: list = []
    trainer = threading.Thread(target=lambda: results.append(launch(
        1, run_timed_updates, Case(src, Layout(1, 1)),
        [([svc.url], {"transport": "broadcast", "bucket_bytes": SMALL, "timeout_s": 20})])))
    trainer.start()
    eng = ReferenceEngine(svc.url)
    deadline = time.monotonic() + 120
    # Bucket 0 loaded: the trainer is past its group, and the workers cannot get past bucket 1 (stall@1).
    while not eng.server_info(refresh=True).get("update_session_loaded"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    seconds = svc.stop(signal.SIGTERM)
    assert seconds <= 5.0, seconds
    svc.assert_clean()
    trainer.join(timeout=120)
    (((entry,),),) = results  # one job, one rank, one update
    assert entry["type"] == "UpdateError" and entry["phase"].startswith("bucket"), entry
    assert entry["seconds"] <= 1.2 * 20 + 5
    assert not _left_behind(shm), _left_behind(shm)


def _raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_bad_requests_get_a_clear_4xx_and_the_engine_keeps_serving(dirs):
    _, eng_dir = dirs
    before = hf_logits(eng_dir, INPUT_IDS)
    with engine(eng_dir, api_key="k") as server:
        url, auth = server.url, {"Authorization": "Bearer k", "Content-Type": "application/json"}
        cases = [
            ("POST", "/init_weights_update_group", b"{not json", auth, 400, "bad JSON"),
            ("POST", "/init_weights_update_group", b"[1, 2]", auth, 400, "must be a JSON object"),
            ("POST", "/init_weights_update_group", json.dumps({"master_port": "80"}).encode(), auth, 400,
             "missing field 'master_address'"),
            ("POST", "/init_weights_update_group", json.dumps({"master_port": "80"}).encode(), auth, 400,
             "field 'master_port' must be int, got str"),
            ("POST", "/update_weights_from_distributed",
             json.dumps({"names": ["a"], "dtypes": ["float99"], "shapes": [[2, -1]]}).encode(), auth, 400,
             "unknown dtypes ['float99']"),
            ("POST", "/update_weights_from_distributed",
             json.dumps({"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[2]]}).encode(), auth, 400,
             "differ in length"),
            ("POST", "/update_weights_from_tensor", json.dumps({"serialized_named_tensors": 7}).encode(), auth, 400,
             "must be list or str, got int"),
            ("POST", "/weightstream/logits", json.dumps({"input_ids": [[1, 2], [3]]}).encode(), auth, 400,
             "one length"),
            ("POST", "/generate", json.dumps({"input_ids": [1, 10**9]}).encode(), auth, 400, "outside the vocabulary"),
            ("POST", "/generate", json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}).encode(),
             auth, 400, "max_new_tokens"),
            ("POST", "/begin_weight_update", json.dumps({"timeout_s": True}).encode(), auth, 400, "got bool"),
            ("POST", "/update_weight_version", b"{}", auth, 400, "missing field 'new_version'"),
            ("POST", "/no_such_route", b"{}", auth, 404, "no route POST /no_such_route"),
            ("GET", "/init_weights_update_group", None, auth, 405, "takes POST, not GET"),
            ("POST", "/generate", b"{}", {**auth, "Content-Length": str(1 << 30)}, 413, "exceeds the limit"),
            ("POST", "/generate", json.dumps({"input_ids": [1]}).encode(), {"Authorization": "Bearer wrong"}, 401,
             "bearer token"),
            ("GET", "/get_server_info", None, {}, 401, "bearer token"),
        ]
        for method, path, body, headers, status, text in cases:
            if "Content-Length" in headers:  # announce a huge body, send none: refused before reading
                host, port = url.removeprefix("http://").split(":")
                with socket.create_connection((host, int(port)), timeout=30) as s:
                    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
                    chunks = []  # the engine answers and closes: read to the end (the body may come apart)
                    while chunk := s.recv(65536):
                        chunks.append(chunk)
                    reply = b"".join(chunks).decode()
                got_status = int(reply.split(" ", 2)[1])
                got = json.loads(reply.split("\r\n\r\n", 1)[1])
            else:
                got_status, got = _raw(url, method, path, body, headers)
            message = got.get("message") or got.get("error", {}).get("message", "")
            assert got_status == status and text in message, (path, got_status, got)
        eng = ReferenceEngine(url, api_key="k")
        assert server.engine.alive() and eng.weight_version() == "default"
        assert not server.engine.session_open
        assert_logits_close(eng.logits(INPUT_IDS), before)
