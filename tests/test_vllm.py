"""A real vLLM server (CPU) updated by a real Megatron trainer through the ``weightstream`` weight-transfer
backend. Needs a python with vLLM and weightstream's ``vllm.general_plugins`` entry point: set
``WEIGHTSTREAM_VLLM_PYTHON`` to it (skipped otherwise; ``WEIGHTSTREAM_REQUIRE_VLLM=1`` makes that a failure)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
import torch

from weightstream.jobs import Layout
from weightstream.launch import free_port, launch

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
    def __init__(self, python: str, model_dir: str, log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1",
                   VLLM_PLUGINS="weightstream", PYTHONWARNINGS="ignore")
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
             "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "256",
             "--dtype", "float32", "--weight-transfer-config", json.dumps({"backend": "weightstream"})],
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

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
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


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-llama"])
def test_vllm_update_from_megatron(preset, tmp_path):
    from weightstream.engines.vllm import VLLMEngine
    from weightstream.models.presets import save_random_checkpoint

    python = _vllm_python()
    cfg = _config(preset)
    engine_dir = save_random_checkpoint(cfg, tmp_path / "engine", seed=1)
    trainer_dir = save_random_checkpoint(cfg, tmp_path / "trainer", seed=2)

    server = VLLMServer(python, engine_dir, str(tmp_path / "vllm.log"))
    try:
        server.wait_healthy()
        print(f"\n{preset}: vLLM healthy after {server.ready_s:.1f} s")
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
    finally:
        server.stop()
