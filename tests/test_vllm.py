"""A real vLLM server (CPU) updated by a real Megatron trainer through the ``weightstream`` weight-transfer
backend, and by a transformers trainer with delta updates its workers apply. Needs a python with vLLM and
weightstream's ``vllm.general_plugins`` entry point: set ``WEIGHTSTREAM_VLLM_PYTHON`` to it (skipped otherwise;
``WEIGHTSTREAM_REQUIRE_VLLM=1`` makes that a failure). The unit tests at the end need no vLLM."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
import torch

from tests.helpers.delta_workers import HFAdamTrainer
from weightstream.engines.base import BROADCAST, DELTA, DeltaChecks
from weightstream.engines.vllm import WORKER_EXTENSION, VLLMEngine, WorkerDelta, engine_delta, worker_deltas
from weightstream.integrations.vllm_backend import WeightstreamUpdateInfo, delta_state
from weightstream.jobs import Layout
from weightstream.launch import free_port, launch
from weightstream.receiver.deltas import HeldDeltas
from weightstream.receiver.programs import dense_layout
from weightstream.streaming.delta import Snapshot

VLLM_PYTHON = os.environ.get("WEIGHTSTREAM_VLLM_PYTHON", "")
PROMPTS = [[3, 14, 159, 265, 358, 979, 323, 846], [999, 0, 1, 2, 500, 501, 77, 88, 99, 111]]
MAX_TOKENS = 8
START_TIMEOUT_S = 240.0


def _vllm_python() -> str:
    problem = None
    if not VLLM_PYTHON:
        problem = "WEIGHTSTREAM_VLLM_PYTHON is not set"
    else:
        probe = subprocess.run(
            [VLLM_PYTHON, "-c", "import vllm, weightstream.integrations.vllm_backend;"
             "from importlib.metadata import entry_points;"
             "assert any(e.name == 'weightstream' for e in entry_points(group='vllm.general_plugins')), "
             "'no weightstream vllm.general_plugins entry point'"],
            capture_output=True, text=True, timeout=120)
        if probe.returncode:
            problem = f"{VLLM_PYTHON} cannot run the vLLM backend: {probe.stderr.strip()[-500:]}"
    if problem:
        if os.environ.get("WEIGHTSTREAM_REQUIRE_VLLM") == "1":
            pytest.fail(problem + " (WEIGHTSTREAM_REQUIRE_VLLM=1)")
        pytest.skip(problem)
    return VLLM_PYTHON


def _config(preset: str):
    """A tiny preset with head_dim 32 (vLLM's CPU attention needs head sizes of at least 32)."""
    from weightstream.models.presets import preset_config

    cfg = preset_config(preset)
    if cfg.head_dim < 32:
        cfg.head_dim = 32
    return cfg


class VLLMServer:
    def __init__(self, python: str, model_dir: str, log_path: str, tp: int = 1):
        """``tp`` > 1: vLLM's workers as processes, each bound to a core of its own (vLLM's CPU workers bind one
        NUMA node each by default; this machine has one)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1",
                   VLLM_PLUGINS="weightstream", PYTHONWARNINGS="ignore")
        parallel = []
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
            parallel = ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
             "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "256",
             "--dtype", "float32", "--weight-transfer-config", json.dumps({"backend": "weightstream"}),
             "--worker-extension-cls", WORKER_EXTENSION, *parallel],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.ready_s = None

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM not healthy within {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self._log.close()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    return greedy_of(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), prompts, max_tokens)


def greedy_of(model, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """HF's greedy token ids after each prompt."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt):])
    return out


def vllm_update(src: str, layout: Layout, url: str, version: str) -> dict:
    """On every trainer rank: build Megatron from ``src`` and push it into the vLLM server at ``url``."""
    import weightstream as ws
    from tests.helpers.workers import Case, _build

    cfg, chunks = _build(Case(src, layout))
    # engine="auto": the adapter is chosen by asking the server what it is.
    report = ws.update_weights(chunks, cfg, url, transport="broadcast", checksums=True,
                               bucket_bytes=256 << 10, weight_version=version, timeout_s=120)
    return {"weight_version": report.weight_version, "buckets": report.buckets, "tensors": report.tensors,
            "transport": report.transport, "summary": report.summary()}


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    """One vLLM server on a tiny Qwen3 (seed 1) for the module: the Megatron update of that preset runs on it
    first (it reads the engine's starting weights, so it is the last of its parametrization, the test just before
    the delta updates), then the delta updates, whose first update is a full one whatever the engine holds.
    Yields the server and the directory of its starting weights."""
    from weightstream.models.presets import save_random_checkpoint

    python = _vllm_python()
    root = tmp_path_factory.mktemp("vllm-qwen3")
    engine_dir = save_random_checkpoint(_config("tiny-qwen3"), root / "engine", seed=1)
    server = VLLMServer(python, engine_dir, str(root / "vllm.log"))
    try:
        server.wait_healthy()
        print(f"\ntiny-qwen3: vLLM healthy after {server.ready_s:.1f} s")
        yield server, engine_dir
    finally:
        server.stop()


def _server_of(preset: str, tmp_path, request: pytest.FixtureRequest):
    """The module's Qwen3 server, or for another preset a server of its own (stopped at the test's end)."""
    from weightstream.models.presets import save_random_checkpoint

    if preset == "tiny-qwen3":
        return request.getfixturevalue("qwen3_server")
    python = _vllm_python()
    engine_dir = save_random_checkpoint(_config(preset), tmp_path / "engine", seed=1)
    server = VLLMServer(python, engine_dir, str(tmp_path / "vllm.log"))
    request.addfinalizer(server.stop)
    server.wait_healthy()
    print(f"\n{preset}: vLLM healthy after {server.ready_s:.1f} s")
    return server, engine_dir


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama", "tiny-qwen3"])
def test_vllm_update_from_megatron(preset, tmp_path, request):
    from weightstream.models.presets import save_random_checkpoint

    server, engine_dir = _server_of(preset, tmp_path, request)
    cfg = _config(preset)
    trainer_dir = save_random_checkpoint(cfg, tmp_path / "trainer", seed=2)

    engine = VLLMEngine(server.url, timeout_s=120)
    info = engine.info()
    assert (info.tp_size, info.pp_size, info.dp_size) == (1, 1, 1) and info.can("broadcast"), info

    before = [engine.greedy(p, MAX_TOKENS) for p in PROMPTS]
    assert before == hf_greedy(engine_dir, PROMPTS), server.tail()
    expected = hf_greedy(trainer_dir, PROMPTS)
    assert expected != before  # the update must change what the engine answers

    t = time.monotonic()
    reports = launch(2, vllm_update, trainer_dir, Layout(2, 1), server.url, "v-7", timeout_s=300)
    print(f"{preset}: update {reports[0]['summary']} ({time.monotonic() - t:.1f} s with the trainer's start)")
    assert [r["weight_version"] for r in reports] == ["v-7", "v-7"]
    assert reports[0]["transport"] == "broadcast"
    assert engine.weight_version() == "v-7"

    after = [engine.greedy(p, MAX_TOKENS) for p in PROMPTS]
    assert after == expected, server.tail()


# -- delta updates ---------------------------------------------------------------------------------------

SMALL = 120_000  # bytes per bucket: the tiny model travels in several buckets


class DeltaTrainer(HFAdamTrainer):
    """:class:`HFAdamTrainer` at lr 1e-5, and HF's greedy tokens with its bf16 weights."""

    def __init__(self, config, seed: int, lr: float = 1e-5):
        super().__init__(config, seed, lr)

    def greedy(self) -> list[list[int]]:
        """HF's greedy tokens with the trainer's bf16 weights (in fp32, as the vLLM under test serves them)."""
        return greedy_of(copy.deepcopy(self.model).float().eval(), PROMPTS)


def _update(sync, trainer: DeltaTrainer, engine: VLLMEngine, version: str):
    """One update of ``sync``; vLLM then serves ``version`` and answers HF's greedy tokens with the trainer's
    weights."""
    report = sync.update(trainer.model, trainer.config, weight_version=version)
    print(f"{version}: {report.summary()}; encodings {report.delta.encodings}")
    assert report.transport == "broadcast" and report.weight_version == version, report.summary()
    assert engine.weight_version() == version
    assert [engine.greedy(p, MAX_TOKENS) for p in PROMPTS] == trainer.greedy(), report.summary()
    return report


def _vllm_weight_checksums(engine: VLLMEngine) -> dict[str, str]:
    """vLLM's own sha256 of each of its parameters (``/weight_checker``)."""
    return engine.post("/weight_checker", {"action": "checksum"}, step="weight_checker")["checksums"]


def test_vllm_delta_updates(qwen3_server):
    """A transformers trainer (Adam, bf16 weights) into a real vLLM whose workers apply the deltas: a first full
    update, then deltas checked by the workers' checksums, vLLM's greedy tokens HF's after each, and its
    parameters bit for bit those a full update of the same weights leaves. A plain update in between leaves the
    workers no base (the next update is full, saying why); another trainer's update under the same version name
    leaves them other bytes, which the check catches (the update goes again in full)."""
    import weightstream as ws

    server, _ = qwen3_server  # started for the module; whatever weights it serves, the first update is full
    cfg = _config("tiny-qwen3")
    engine = VLLMEngine(server.url, timeout_s=120)
    assert {BROADCAST, DELTA} <= engine.info().capabilities
    trainer = DeltaTrainer(cfg, seed=2)
    with ws.WeightSync([server.url], transport="broadcast", delta=True, bucket_bytes=SMALL,
                       timeout_s=120) as sync:
        first = _update(sync, trainer, engine, "v0").delta
        assert (first.full, first.reason, first.checked) == (True, "the first update", True)
        for step in range(1, 4):
            trainer.step()
            report = _update(sync, trainer, engine, f"v{step}")
            d = report.delta
            assert (d.full, d.checked, d.mismatch) == (False, True, None), report.summary()
            assert d.reason == f"deltas against version v{step - 1}"
            assert set(d.encodings) - {"dense"} and 0 < d.changed < d.words, d.encodings
            assert 0 < d.wire_bytes < report.bytes / 2, report.summary()
        base = engine.delta_base()
        assert base is not None and base.endswith("/v3")
        sync.close()

        # The same weights in full by a plain update: vLLM's parameters are the ones the deltas left.
        applied = _vllm_weight_checksums(engine)
        ws.update_weights(trainer.model, cfg, server.url, transport="broadcast", bucket_bytes=SMALL,
                          weight_version="v3-plain", timeout_s=120)
        assert _vllm_weight_checksums(engine) == applied
        assert engine.delta_base() is None  # its buckets were not kept

        trainer.step()
        d = _update(sync, trainer, engine, "v4").delta
        assert (d.full, d.checked) == (True, True)
        assert d.reason == (f"engine {server.url} holds nothing to apply deltas to, not what this trainer "
                            f"committed ({base}): restarted, rolled back or updated elsewhere")
        sync.close()

        # Another trainer commits its weights under the name this one committed last: the workers' base
        # names what this trainer expects, their bytes are the other's.
        other = DeltaTrainer(cfg, seed=3)
        with ws.WeightSync([server.url], transport="broadcast", delta=True, bucket_bytes=SMALL,
                           timeout_s=120) as sync2:
            assert sync2.update(other.model, cfg, weight_version="v4").delta.full
        trainer.step()
        d = _update(sync, trainer, engine, "v5").delta
        assert d.mismatch is not None and d.mismatch.startswith(
            f"engine {server.url}: the bytes it applied of buckets [0, 1, "), d.mismatch
        assert (d.full, d.checked) == (True, True) and d.reason.startswith("the check of the last attempt found")

        trainer.step()
        d = _update(sync, trainer, engine, "v6").delta
        assert (d.full, d.checked, d.reason) == (False, True, "deltas against version v5")


def test_vllm_delta_updates_at_tp2(tmp_path):
    """vLLM at TP 2 (two worker processes): each worker keeps the whole buckets and applies every delta itself, then
    loads its shard through vLLM's own loader; a full update then deltas, each checked against every worker's
    checksums, vLLM's greedy tokens HF's after each, and its parameters bit for bit those a plain full update of
    the same weights leaves."""
    import weightstream as ws
    from weightstream.models.presets import save_random_checkpoint

    python = _vllm_python()
    cfg = _config("tiny-qwen3")
    server = VLLMServer(python, save_random_checkpoint(cfg, tmp_path / "engine", seed=1), str(tmp_path / "vllm.log"),
                        tp=2)
    try:
        server.wait_healthy()
        engine = VLLMEngine(server.url, timeout_s=120)
        assert engine.info().tp_size == 2 and {BROADCAST, DELTA} <= engine.info().capabilities
        trainer = DeltaTrainer(cfg, seed=2)
        with ws.WeightSync([server.url], transport="broadcast", delta=True, bucket_bytes=SMALL,
                           timeout_s=120) as sync:
            first = _update(sync, trainer, engine, "v0").delta
            assert (first.full, first.checked) == (True, True)
            for step in (1, 2):
                trainer.step()
                d = _update(sync, trainer, engine, f"v{step}").delta
                assert (d.full, d.checked, d.mismatch) == (False, True, None)
                assert set(d.encodings) - {"dense"} and 0 < d.wire_bytes < d.words
            applied = _vllm_weight_checksums(engine)
        ws.update_weights(trainer.model, cfg, server.url, transport="broadcast", bucket_bytes=SMALL,
                          weight_version="v2-plain", timeout_s=120)
        assert _vllm_weight_checksums(engine) == applied
    finally:
        server.stop()


@pytest.mark.unit
def test_vllm_declares_delta_only_with_the_worker_extension():
    from weightstream.engines.vllm import BACKEND
    from weightstream.integrations import vllm_backend

    assert (BACKEND, WORKER_EXTENSION) == (vllm_backend.BACKEND_NAME, vllm_backend.WORKER_EXTENSION)
    engine = VLLMEngine("http://127.0.0.1:9")
    ours = {"weight_transfer_backend": "weightstream", "worker_extension": WORKER_EXTENSION}
    assert engine.capabilities(ours) == {BROADCAST, DELTA}
    assert engine.capabilities({**ours, "worker_extension": None}) == {BROADCAST}
    assert engine.capabilities({**ours, "weight_transfer_backend": "nccl"}) == {BROADCAST}
    assert engine.capabilities({**ours, "pp_size": 2}) == frozenset()


@pytest.mark.unit
def test_engine_delta_from_its_workers():
    one = {"instance": "a1", "version": "v3", "held_bytes": 8, "buckets": {"0": "x", "1": "y"}}
    two = {"instance": "b2", "version": "v3", "held_bytes": 8, "buckets": {"0": "x"}}
    assert engine_delta(worker_deltas({"results": [one, two]})) == DeltaChecks(
        "a1+b2", "a1+b2/v3", {0: ("x", "x"), 1: ("y", "")})
    # a worker without the version (restarted, aborted): no base
    assert engine_delta([WorkerDelta("a1", "v3", {}), WorkerDelta("b2", None, {})]).base is None
    with pytest.raises(ValueError, match=r"worker 0: .*; worker 1: 7"):
        worker_deltas({"results": [{"instance": 1, "version": None, "buckets": {}}, 7]})


@pytest.mark.unit
def test_vllm_update_info_lists_every_problem():
    with pytest.raises(ValueError) as err:
        WeightstreamUpdateInfo(names=["a", "b"], dtype_names=["bfloat16", "f16"], shapes=[[4], [-1]],
                               weightstream_delta={"encoding": "zip", "word": 2, "total": 8, "count": 1, "nbytes": 2})
    assert str(err.value) == (
        "bad update_info: unknown dtype_names ['f16']; shapes must be lists of non-negative integers; "
        "weightstream_delta.index must be a non-negative integer; weightstream_delta.encoding must be one of "
        "['dense', 'indices', 'bitmap'], got 'zip'")
    with pytest.raises(ValueError) as err:
        WeightstreamUpdateInfo(names=["a"], dtype_names=["bfloat16"], shapes=[[4]], weightstream_delta={
            "encoding": "indices", "word": 2, "total": 16, "count": 1, "nbytes": 2, "index": 0})
    assert str(err.value) == ("bad update_info: weightstream_delta.total 16 is not the bucket's 8 bytes; "
                              "weightstream_delta.nbytes 2 is not the 6 bytes of indices for 1 changed words")


@pytest.mark.unit
def test_held_deltas_apply_deltas_and_keep_a_base_only_once_committed():
    """What a vLLM worker keeps (the receiver layer's HeldDeltas): the sender's payloads applied give the sender's
    bytes (and checksums); only a committed session of delta buckets leaves a version; an uncommitted one leaves
    none and its bytes are dropped when the next session opens; a plain bucket drops them at once; what
    ``weightstream_delta_state`` answers says so."""
    gen = torch.Generator().manual_seed(0)
    layout = tuple(dense_layout(["w"], ["bfloat16"], [[4096]]))
    bucket = torch.randn(4096, generator=gen).to(torch.bfloat16)
    snapshot, held = Snapshot("host"), HeldDeltas(limit=2 * 8192)

    def send(full: bool) -> torch.Tensor:
        snapshot.begin(full=full)
        header, payload = snapshot.encode(0, bucket.view(torch.uint8), 2)
        return held.new_bytes(0, layout, 8192, header, payload.clone(), None)

    held.begin()
    assert torch.equal(send(full=True), bucket.view(torch.uint8)) and held.version is None
    held.commit("v0")
    assert (held.version, held.digests) == ("v0", snapshot.digests)
    assert delta_state(held) == {"instance": held.instance, "version": "v0", "held_bytes": 8192,
                                 "buckets": {"0": snapshot.digests[0]}}
    held.begin()
    bucket[::50] += 1
    assert torch.equal(send(full=False), bucket.view(torch.uint8)) and snapshot.headers[0].encoding == "indices"
    assert held.version is None and held.digests == snapshot.digests
    held.begin()  # the session was not committed (aborted): its bytes are dropped, a full update must come
    assert held.held == {} and delta_state(held) == {"instance": held.instance, "version": None, "held_bytes": 0,
                                                     "buckets": {}}
    with pytest.raises(ValueError, match="holds no bytes of that bucket"):
        send(full=False)
    held.begin()
    send(full=True)
    held.loaded_whole()  # a bucket loaded whole in the same session: nothing is kept, no version after it
    held.commit("v1")
    assert (held.held, held.version) == ({}, None)
