"""Colocated (IPC) updates on the CPU across the lives of separate trainer processes: any number of trainers
one after another update the same engine; a trainer's exit, however it exits, leaves nothing behind (no
process holding its stdio, nothing mapped in the engine, nothing in /dev/shm) within the bound the engine
states (docs/engines.md); and a payload may map only the shared memory of the processes the session knows.

Each trainer here is its own process (a Megatron-Core model built from a checkpoint, one ``WeightSync``),
as users run them; the engine is the reference engine, its worker a process of its own."""

from __future__ import annotations

import base64
import collections
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.workers import INPUT_IDS
from tests.test_update import engine
from weightstream.engines import EngineError, ReferenceEngine
from weightstream.launch import free_port
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.wire.handles import (
    SHM_HEADER_BYTES,
    UnsafePayloadError,
    dumps_b64,
    loads,
    loads_b64,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_and_update.py")
RELEASE_BOUND_S = 1.0  # docs/engines.md: what the engine mapped of a trainer is let go within this of its exit
T = 3.0  # the trainers' timeout_s: a session whose trainer died mid-update is given up T + 2 s after its last word
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}

TRAINER = r"""
import json, os, sys, time
import torch.distributed as dist
from weightstream.launch import free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
import weightstream as ws
from weightstream.common.hf_files import CheckpointReader
from weightstream.checks.megatron_models import build_gpt_model, initialize_parallel, load_hf_weights
from weightstream.sinks import IPCSink

src, url, how, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
initialize_parallel(1, 1)
chunks = build_gpt_model(src)
with CheckpointReader(src) as reader:
    load_hf_weights(chunks, src, reader)


def managers():
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and comm == "torch_shm_manager"[:15]:  # comm: 15 characters
            out.append(int(pid))
    return out


if how == "die_mid_update":
    send = IPCSink.send
    def send_then_die(self, bucket):
        send(self, bucket)
        if bucket.index == 2:
            print("dying", flush=True)
            os._exit(9)
    IPCSink.send = send_then_die
with ws.WeightSync([url], transport="ipc", bucket_bytes=100_000, timeout_s=float(options.pop("timeout_s", 30)),
                   **options) as sync:
    report = sync.update(chunks, src)
    print(json.dumps({"pid": os.getpid(), "direct": report.direct, "ahead": report.metadata_ahead,
                      "managers": managers()}), flush=True)
    if how == "die_after_update":
        time.sleep(600)  # SIGKILLed by the test, its lease open and its buffers mapped by the engine
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    """The engine's start (0) and five trainers' weights (1-5), all of one config."""
    root = tmp_path_factory.mktemp("lifecycle")
    cfg = preset_config("tiny-qwen3")
    return [save_random_checkpoint(cfg, root / f"w{i}", seed=200 + i) for i in range(6)]


@pytest.fixture(scope="module")
def trainer_script(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("trainer") / "trainer.py"
    path.write_text(TRAINER)
    return str(path)


# -- what a process holds, seen from outside -----------------------------------------------------------


def _shm_named_by(pids: set[int]) -> list[str]:
    """/dev/shm entries torch named for one of ``pids`` (``torch_<pid>_...``)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("torch_") and int(n.split("_")[1]) in pids]


def _held(pid: int) -> SimpleNamespace:
    """A process's descriptors (how many, and what they are) and its shared-memory mappings (by inode)."""
    with open(f"/proc/{pid}/maps") as f:
        shared = {line.split()[4] for line in f if "/dev/shm/" in line or "/memfd:" in line}
    what = sorted(_link(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    return SimpleNamespace(fds=len(what), what=what, shared=shared)


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "(closed)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _until(check, bound_s: float, step_s: float = 0.02) -> float:
    """Seconds until ``check()`` holds, polled; fails past ``bound_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > bound_s:
            raise AssertionError(f"not within {bound_s} s")
        time.sleep(step_s)
    return time.monotonic() - start


def _train(script: str, src: str, url: str, how: str = "update", timeout: float = 240, **options) -> dict:
    """A trainer process that updates the engine at ``url`` with ``src``'s weights; its report."""
    proc = subprocess.run([sys.executable, script, src, url, how, json.dumps(options)], capture_output=True,
                          text=True, timeout=timeout, env=ENV, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _start(script: str, src: str, url: str, how: str, **options) -> subprocess.Popen:
    """A trainer process left running (its stderr in a file: a pipe nobody reads could fill and stop it)."""
    log = tempfile.TemporaryFile("w+")  # lives as long as the process, read if it fails
    proc = subprocess.Popen([sys.executable, script, src, url, how, json.dumps(options)], stdout=subprocess.PIPE,
                            stderr=log, text=True, env=ENV)
    proc.log = log
    return proc


def _first_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        proc.log.seek(0)
        raise AssertionError(f"the trainer exited {proc.returncode} without a word:\n{proc.log.read()[-4000:]}")
    return line.strip()


def _settled(eng: ReferenceEngine, worker: int) -> SimpleNamespace:
    """What the worker holds once it holds nothing of any trainer (no kept buffer, no lease: what the last one
    left is let go of within the bound), awaited on that condition."""
    def idle() -> bool:
        memory = eng.get("/weightstream/memory")["ranks"][0]
        return (memory["ipc_buffers_held"], memory["ipc_lease"]) == (0, False)

    _until(idle, RELEASE_BOUND_S)
    return _held(worker)


def _worker_pid(server) -> int:
    (proc,) = server.engine.procs
    return proc.pid


# -- (1) D2: any number of trainers, one after another -------------------------------------------------


def test_three_trainers_one_after_another_each_update_the_engine(checkpoints, trainer_script):
    """Three trainer processes in turn, each one IPC update into the same engine (TP 1), written straight into
    the engine's weights. Each succeeds and the engine then answers its weights' logits; between trainers
    the engine holds no more than after the first (no descriptor, mapping or /dev/shm entry of a departed
    trainer)."""
    eng_dir, *sources = checkpoints
    with engine(eng_dir) as server:
        eng = ReferenceEngine(server.url, timeout_s=30)
        worker, seen = _worker_pid(server), []
        for i, src in enumerate(sources[:3]):
            start = time.monotonic()
            report = _train(trainer_script, src, server.url)
            took = time.monotonic() - start
            assert report["ahead"] and report["direct"], report
            assert report["managers"] == [], report  # no shared-memory manager was started by the trainer
            assert_logits_close(eng.logits(INPUT_IDS), hf_logits(src, INPUT_IDS))
            _until(lambda: not eng.get("/weightstream/memory")["ranks"][0]["ipc_lease"], RELEASE_BOUND_S)
            held = _held(worker)
            seen.append(held)
            assert not _shm_named_by({report["pid"], worker}), os.listdir("/dev/shm")
            print(f"trainer {i + 1}: {took:.1f} s; engine worker: {held.fds} descriptors, "
                  f"{len(held.shared)} shared mappings")
        # The engine's own weights went into shared memory for the first trainer that wrote into them; nothing
        # of any trainer stays.
        assert seen[1].fds == seen[2].fds, [h.fds for h in seen]
        assert seen[1].shared == seen[2].shared


# -- (2) a trainer under torchrun whose output a shell captures ----------------------------------------


def test_torchrun_trainer_captured_by_the_shell_returns(tmp_path, checkpoints):
    """``out=$(torchrun ... train.py)``: the shell's capture ends when the last process holding the pipe
    does. Two trainer ranks update an engine at TP 2 over IPC (each rank's kept buffers mapped by its
    engine rank) and exit; no process they started holds their stdout, so the capture returns at once."""
    eng_dir, src = checkpoints[0], checkpoints[5]
    out = tmp_path / "out"
    out.mkdir()
    with engine(eng_dir, tp=2) as server:
        torchrun = " ".join([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()), SCRIPT, "--src", src, "--engine", server.url,
                             "--transport", "ipc", "--tp", "2", "--out", str(out)])
        start = time.monotonic()
        proc = subprocess.run(["bash", "-c", f"out=$({torchrun} 2>&1); echo \"$out\" | tail -n 20; echo done"],
                              capture_output=True, text=True, timeout=300, env=ENV, check=False)
        took = time.monotonic() - start
        assert proc.stdout.rstrip().endswith("done"), proc.stdout[-3000:] + proc.stderr[-3000:]
        reports = json.loads((out / "reports.json").read_text())
        assert [r["transport"] for r in reports] == ["ipc", "ipc"] and all(r["ahead"] for r in reports), reports
        logits = ReferenceEngine(server.url).logits(INPUT_IDS)
    assert_logits_close(logits, hf_logits(str(out / "step1"), INPUT_IDS))
    print(f"torchrun trainer, output captured by $(...): returned after {took:.1f} s")


# -- (3) a trainer killed: nothing of it stays, the engine serves and takes the next ---------------------


def _kill(proc: subprocess.Popen) -> float:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    return time.monotonic()


def test_killed_trainer_leaves_nothing_in_the_engine_within_the_bound(checkpoints, trainer_script):
    """A trainer SIGKILLed after its update, with its lease open and its two kept buffers mapped by the
    engine: within the bound the engine's descriptors and shared mappings are what they were before it
    came, /dev/shm holds nothing of it, the engine serves its weights and the next trainer's update
    succeeds. Then a trainer killed mid-update (writing into the engine's weights): the same, and the
    engine gives its session up and serves the last committed weights."""
    eng_dir, a, b, c, d, _ = checkpoints
    with engine(eng_dir) as server:
        eng = ReferenceEngine(server.url, timeout_s=30)
        worker = _worker_pid(server)
        eng.logits(INPUT_IDS)  # the model run once, as it is before every comparison below
        before = _settled(eng, worker)
        with ExitStack() as stack:
            proc = _start(trainer_script, a, server.url, "die_after_update", direct=False)
            stack.callback(proc.kill)
            report = json.loads(_first_line(proc))
            memory = eng.get("/weightstream/memory")["ranks"][0]
            assert (memory["ipc_buffers_held"], memory["ipc_lease"]) == (2, True), memory
            assert _held(worker).fds > before.fds
            died = _kill(proc)
        released = _until(lambda: _held(worker).fds == before.fds and _held(worker).shared == before.shared,
                          RELEASE_BOUND_S)
        print(f"killed after its update: the engine let go of what it mapped {released:.3f} s after the kill "
              f"(bound {RELEASE_BOUND_S} s; {time.monotonic() - died:.3f} s by the time it was seen)")
        memory = eng.get("/weightstream/memory")["ranks"][0]
        assert (memory["ipc_buffers_held"], memory["ipc_lease"]) == (0, False), memory
        assert not _shm_named_by({report["pid"], worker})
        assert_logits_close(eng.logits(INPUT_IDS), hf_logits(a, INPUT_IDS))

        report = _train(trainer_script, b, server.url, direct=True)
        assert report["direct"]
        assert_logits_close(eng.logits(INPUT_IDS), hf_logits(b, INPUT_IDS))
        settled = _settled(eng, worker)  # now with the engine's own weights in shared memory (the export)

        proc = _start(trainer_script, c, server.url, "die_mid_update", direct=True, timeout_s=T)
        assert _first_line(proc) == "dying"
        died = _kill(proc)
        released = _until(lambda: _held(worker).fds == settled.fds and _held(worker).shared == settled.shared,
                          RELEASE_BOUND_S)
        assert not _shm_named_by({proc.pid, worker})
        _until(lambda: not server.engine.session_open, T + 4)
        print(f"killed mid-update: released {released:.3f} s after the kill; session given up "
              f"{time.monotonic() - died:.1f} s after it (bound T + 2 = {T + 2:.0f} s)")
        assert_logits_close(eng.logits(INPUT_IDS), hf_logits(b, INPUT_IDS))  # rolled back

        _train(trainer_script, d, server.url, direct=False)
        assert_logits_close(eng.logits(INPUT_IDS), hf_logits(d, INPUT_IDS))


def test_no_rollback_engine_is_repaired_after_every_killed_trainer(checkpoints, trainer_script):
    """``--no-rollback``: twice a trainer is killed mid-way through writing into the engine's weights
    (the engine then refuses to serve) and a fresh trainer process repairs it with a complete update."""
    eng_dir, *sources = checkpoints
    with engine(eng_dir, rollback=False) as server:
        eng = ReferenceEngine(server.url, timeout_s=30)
        for trial in range(2):
            proc = _start(trainer_script, sources[trial], server.url, "die_mid_update", direct=True, timeout_s=T)
            assert _first_line(proc) == "dying"
            _kill(proc)
            _until(lambda: not server.engine.session_open, T + 4)
            with pytest.raises(EngineError, match="half-updated by an aborted update"):
                eng.logits(INPUT_IDS)
            repair = sources[trial + 1]
            assert _train(trainer_script, repair, server.url, direct=True)["direct"]
            assert_logits_close(eng.logits(INPUT_IDS), hf_logits(repair, INPUT_IDS))


# -- D15b: a client of the per-bucket route leaves nothing behind --------------------------------------


def test_per_bucket_clients_leave_no_manager_descriptor_or_file(checkpoints, trainer_script):
    """Trainers that send one request per bucket (torch's named shared memory, as SGLang's route takes it):
    each announces itself on the control channel first, its payloads are mapped by the engine without its
    ``torch_shm_manager``; after each exits the engine holds what it held before, the manager it started
    has gone with it and /dev/shm holds nothing of it."""
    eng_dir, *sources = checkpoints
    with engine(eng_dir) as server:
        eng = ReferenceEngine(server.url, timeout_s=30)
        worker = _worker_pid(server)
        eng.logits(INPUT_IDS)  # the model run once, as it is before every comparison below
        before = _settled(eng, worker)
        for src in sources[:2]:
            report = _train(trainer_script, src, server.url, metadata_ahead=False)
            assert not report["ahead"] and len(report["managers"]) == 1, report
            assert_logits_close(eng.logits(INPUT_IDS), hf_logits(src, INPUT_IDS))
            manager = report["managers"][0]
            gone = _until(lambda m=manager: not _alive(m), 5.0)
            try:
                _until(lambda: _held(worker).fds == before.fds, RELEASE_BOUND_S)
            except AssertionError:
                now = collections.Counter(_held(worker).what)
                raise AssertionError(f"the engine worker holds {dict(now - collections.Counter(before.what))} more "
                                     f"and {dict(collections.Counter(before.what) - now)} fewer than before") from None
            assert _held(worker).shared == before.shared
            assert not _shm_named_by({report["pid"], worker}), os.listdir("/dev/shm")
            print(f"per-bucket trainer: its manager ended {gone:.2f} s after it")


# -- the shared-memory manager's stdio -----------------------------------------------------------------

HOLDS_IT_OPEN = r"""
import sys, time
from torch.multiprocessing import reductions
import torch
manager, handle, size = sys.argv[1].encode(), sys.argv[2].encode(), int(sys.argv[3])
storage = reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)  # torch's own way
print("mapped", flush=True)
time.sleep(30)
"""

SHARES = r"""
import subprocess, sys, time, torch
from weightstream.wire.handles import dumps
buf = torch.zeros(1000, dtype=torch.uint8)
dumps(buf)  # a file_system share: starts this process's torch_shm_manager
manager, handle, size = buf.untyped_storage()._share_filename_cpu_()
holder = subprocess.Popen([sys.executable, sys.argv[1], manager, handle, str(size)], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, start_new_session=True)
assert holder.stdout.readline() == b"mapped\n"
print(holder.pid, time.time(), flush=True)  # then this process exits
"""


def test_the_shm_manager_holds_nothing_of_its_process(tmp_path):
    """A process whose shared memory another process still maps (through the manager, as torch's own
    receivers do) exits; the manager lives on while that mapping does, but holds neither the exited
    process's stdout nor its stderr: a shell capturing them returns at once."""
    script, holds = tmp_path / "shares.py", tmp_path / "holds.py"
    script.write_text(SHARES)
    holds.write_text(HOLDS_IT_OPEN)
    proc = subprocess.run(["bash", "-c", f"out=$({sys.executable} {script} {holds} 2>&1); echo \"$out\""],
                          capture_output=True, text=True, timeout=60, env=ENV, check=False)
    returned = time.time()
    holder, exited = proc.stdout.strip().splitlines()[-1].split()
    try:
        assert _alive(int(holder))  # still mapping the departed process's memory, through its manager
    finally:
        os.kill(int(holder), signal.SIGKILL)
    took = returned - float(exited)
    assert took < 5, took  # the holder lives 30 s: a manager holding the pipe would keep the capture that long
    print(f"captured output returned {took:.2f} s after the process exited, another still mapping its memory")


# -- (4) D3: payloads map only what the session's trainer announced ------------------------------------


class _Rebuild:
    """A payload that names a global with arguments of its choosing (what an attacker would send)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payload(flat) -> str:
    return base64.b64encode(pickle.dumps({"flattened_tensor": flat, "metadata": []}, protocol=5)).decode()


VICTIM = r"""
import sys, time, torch
buf = torch.full((4096,), 83, dtype=torch.uint8)  # 'S'
manager, handle, size = buf.untyped_storage()._share_filename_cpu_()
print(manager.decode(), handle.decode(), size, flush=True)
time.sleep(60)
"""


def test_payloads_may_map_only_what_the_session_announced(checkpoints, tmp_path):
    """Through ``/update_weights_from_tensor`` in an open session: a payload naming an object in /dev/shm
    that torch did not name, or one of a process that has not announced itself (another process's torch
    shared memory), is refused and the object is left as it was; so are payloads that would make the engine
    allocate what they say (``bytearray(1 GiB)``, ``UntypedStorage(1 GiB)``, ``torch.Tensor(...)``), without
    its memory growing."""
    from torch.multiprocessing import reductions

    victim_name = f"/ws_victim_{uuid.uuid4().hex[:8]}"
    with open("/dev/shm" + victim_name, "wb") as f:
        f.write(b"S" * 92)
    script = tmp_path / "victim.py"
    script.write_text(VICTIM)
    other = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        manager, handle, size = other.stdout.readline().split()
        with open("/dev/shm" + handle, "rb") as f:
            other_before = f.read()
        crafted = {
            "an object torch did not name": _Rebuild(reductions.rebuild_storage_filename, torch.storage.UntypedStorage,
                                                     manager.encode(), victim_name.encode(), 64 << 20),
            "another process's shared memory": _Rebuild(reductions.rebuild_storage_filename,
                                                        torch.storage.UntypedStorage, manager.encode(),
                                                        handle.encode(), int(size)),
            "bytearray": _Rebuild(bytearray, 1 << 30),
            "an untyped storage of 1 GiB": _Rebuild(torch.storage.UntypedStorage, 1 << 30),
            "a tensor of 1 GiB": _Rebuild(torch.Tensor, 1 << 28),
        }
        with engine(checkpoints[0]) as server:
            eng = ReferenceEngine(server.url, timeout_s=30)
            rss = eng.get("/weightstream/memory")["ranks"][0]["rss_bytes"]
            for what, evil in crafted.items():
                eng.begin_update(what)
                with pytest.raises(EngineError, match="refused") as refused:
                    eng.receive_ipc(0, [_payload(evil)], None)
                eng.abort_update()
                print(f"{what}: {str(refused.value).split('refused', 1)[1][:110]}")
            grown = eng.get("/weightstream/memory")["ranks"][0]["rss_bytes"] - rss
            assert_logits_close(eng.logits(INPUT_IDS), hf_logits(checkpoints[0], INPUT_IDS))
        with open("/dev/shm" + victim_name, "rb") as f:
            assert f.read() == b"S" * 92  # not grown, not written
        with open("/dev/shm" + handle, "rb") as f:
            assert f.read() == other_before  # its reference count (the header) included
        assert grown < 64 << 20, grown
    finally:
        other.kill()
        os.unlink("/dev/shm" + victim_name)


def test_allow_list_without_an_engine():
    """In one process: what it shared itself round-trips; the globals that allocate are refused before they
    run; and torch's named shared memory has the layout :data:`SHM_HEADER_BYTES` describes."""
    t = torch.arange(100, dtype=torch.float32)
    assert torch.equal(loads_b64(dumps_b64({"t": t[5:9]}))["t"], t[5:9])
    for evil in (_Rebuild(bytearray, 1 << 30), _Rebuild(bytes, 1 << 30),
                 _Rebuild(torch.storage.UntypedStorage, 1 << 30), _Rebuild(torch.Tensor, 1 << 28)):
        with pytest.raises(UnsafePayloadError, match="refused"):
            loads(pickle.dumps(evil, protocol=5))
    # A CUDA tensor's payload (as torch's reduce_tensor writes it) reaches torch's rebuild with torch's classes
    # in place of the names the payload gave (not run on a GPU here: the rebuild itself is a stand-in).
    from torch.multiprocessing import reductions

    got = []
    cuda = _Rebuild(reductions.rebuild_cuda_tensor, torch.Tensor, (2,), (1,), 0, torch.storage.TypedStorage,
                    torch.float32, 0, b"handle", 8, 0, False, b"/torch_1_2_3", 0, b"event", False)
    data = pickle.dumps(cuda, protocol=5)
    real, reductions.rebuild_cuda_tensor = reductions.rebuild_cuda_tensor, lambda *args: got.append(args)
    try:
        loads(data)
    finally:
        reductions.rebuild_cuda_tensor = real
    (args,) = got
    assert (args[0], args[4], args[5], args[6], args[7]) == (torch.Tensor, torch.storage.TypedStorage,
                                                             torch.float32, 0, b"handle")
    buf = torch.arange(256, dtype=torch.uint8)
    _, handle, size = buf.untyped_storage()._share_filename_cpu_()
    with open("/dev/shm" + handle.decode(), "rb") as f:
        raw = f.read()
    assert len(raw) == size + SHM_HEADER_BYTES and raw[SHM_HEADER_BYTES:] == bytes(range(256))
    assert int.from_bytes(raw[:4], "little") == 1  # the reference count: this process's own
