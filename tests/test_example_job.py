"""``weightstream example``: its checkpoint converts to the HF weights it wrote, bit for bit, into a directory that
serves as it is (tokenizer, model); its training script streams into a real reference engine; and a model type
transformers does not know converts from it once registered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightstream.checks.compare import compare_checkpoints
from weightstream.convert import convert_checkpoint
from weightstream.converters.qwen3 import QWEN3
from weightstream.converters.registry import register_converter, unregister_converter

CLI = [sys.executable, "-c", "import sys; from weightstream.cli import main; sys.exit(main())"]
IDS = [[5, 17, 42, 99, 3, 250, 7]]


def _cli(*args: str, timeout: int = 300, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture(scope="module")
def example(example_job) -> Path:
    root, printed = example_job  # (conftest: the command run once for the session)
    directory = root / "ws-example"
    assert f"weightstream convert {directory / 'checkpoint'} --hf {directory / 'hf'}" in printed
    assert f"torchrun --nproc-per-node 2 {directory / 'train_and_stream.py'}" in printed
    return directory


def _logits(model_dir: str | os.PathLike) -> torch.Tensor:
    """The HF model's logits, computed on one thread as the reference engine's workers compute theirs: on some CPUs
    (an AMD EPYC's, with two threads) a forward's float sums come out in another order with another thread count,
    and the engine's logits are compared with these bit for bit."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model(torch.tensor(IDS)).logits
    finally:
        torch.set_num_threads(threads)


def test_the_example_checkpoint_converts_to_its_hf_weights_into_a_servable_directory(example, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    out = tmp_path / "converted"
    run = _cli("convert", os.fspath(example / "checkpoint"), "--hf", os.fspath(example / "hf"), "--out", os.fspath(out))
    copied = "chat_template.jinja, generation_config.json, tokenizer.json, tokenizer_config.json"
    assert f"copied beside the shards: {copied}" in run.stdout
    cmp = compare_checkpoints(example / "hf", out)
    assert cmp.ok and cmp.compared == 47, cmp.render("hf", "converted")
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "Hello, weightstream! ünïcode 123"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n")
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(example / "hf").to_dict()
    assert torch.equal(_logits(out), _logits(example / "hf"))


def test_dump_copies_the_hf_directory_files_and_says_so(example, tmp_path):
    out = tmp_path / "dumped"
    run = _cli("dump", "--hf", os.fspath(example / "hf"), "--out", os.fspath(out))
    assert "copied beside the shards: chat_template.jinja, generation_config.json, tokenizer.json, " \
           "tokenizer_config.json" in run.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "chat_template.jinja", "config.json", "generation_config.json", "model-00001-of-00001.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"])


def test_the_training_script_streams_into_a_reference_engine(example, tmp_path):
    """The script, as written, under torchrun (TP 2) into a reference engine (TP 1) started on the example's HF
    directory: after its steps the engine's logits are those of the HF model of the weights it trained."""
    from weightstream.engines import ReferenceEngine
    from weightstream.reference_engine.server import serve, stop

    server = serve(os.fspath(example / "hf"), 1, api_key="example-key")
    try:
        trained = tmp_path / "trained"
        env = {**os.environ, "WEIGHTSTREAM_API_KEY": "example-key"}
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              os.fspath(example / "train_and_stream.py"), "--engine", server.url, "--steps", "2",
                              "--save", os.fspath(trained)], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "step 2: loss" in out.stdout
        engine_logits = ReferenceEngine(server.url, api_key="example-key").logits(IDS)
    finally:
        stop(server)
    assert not torch.equal(_logits(trained), _logits(example / "hf"))  # the steps changed the weights
    assert torch.equal(engine_logits, _logits(trained))


RUNS_IF_IMPORTED = "raise RuntimeError('this code ran')\n"


def _acme_config(example: Path, model_type: str) -> dict:
    return {**json.loads((example / "hf" / "config.json").read_text()), "model_type": model_type,
            "architectures": ["AcmeForCausalLM"],
            "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig",
                         "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}}


def test_a_model_type_transformers_does_not_know_converts_once_registered(example, tmp_path):
    """As a directory (with trust_remote_code files, which are copied and never run), a dict, and a config class
    registered with AutoConfig only: every tensor bit-identical to the HF weights, config.json as given."""
    from transformers import AutoConfig, PretrainedConfig

    acme_dir = tmp_path / "acme"
    acme_dir.mkdir()
    fields = _acme_config(example, "acme_job")
    (acme_dir / "config.json").write_text(json.dumps(fields))
    (acme_dir / "configuration_acme.py").write_text(RUNS_IF_IMPORTED)
    (acme_dir / "tokenizer.json").write_bytes((example / "hf" / "tokenizer.json").read_bytes())
    registered = type("AcmeRegisteredConfig", (PretrainedConfig,), {"model_type": "acme_registered"})
    AutoConfig.register("acme_registered", registered)
    given = {"directory": (os.fspath(acme_dir), "acme_job"), "dict": (dict(fields), "acme_job"),
             "registered class": (registered(**{k: v for k, v in fields.items() if k != "model_type"}),
                                  "acme_registered")}
    for name in ("acme_job", "acme_registered"):
        register_converter(name, QWEN3.derive(name))
    try:
        for how, (config, model_type) in given.items():
            out = tmp_path / how.replace(" ", "-")
            report = convert_checkpoint(example / "checkpoint", config, out)
            cmp = compare_checkpoints(example / "hf", out)
            assert cmp.ok and cmp.compared == 47, (how, cmp.render("hf", how))
            written = json.loads((out / "config.json").read_text())
            assert written["model_type"] == model_type and written["auto_map"] == fields["auto_map"], how
            assert report.copied == (["configuration_acme.py", "tokenizer.json"] if how == "directory" else []), how
    finally:
        for name in ("acme_job", "acme_registered"):
            unregister_converter(name)
