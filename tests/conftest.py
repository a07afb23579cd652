import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PYTHONWARNINGS", "ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

FAMILIES = ("tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied")


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """Under ``-m unit``, a test module that marks no test unit is not imported at all: what it imports (a
    Megatron-Core job's helpers, engines) is most of the fast subset's time otherwise."""
    if config.getoption("markexpr") != "unit" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "mark.unit" not in collection_path.read_text()


@pytest.fixture(scope="session")
def example_job(tmp_path_factory) -> tuple[Path, str]:
    """``weightstream example ws-example`` run as the README says, once for the session: the directory it ran in
    (``ws-example`` inside it) and what it printed. Tests read the job and write beside it, never into it."""
    root = tmp_path_factory.mktemp("docs")
    cli = os.path.join(os.path.dirname(sys.executable), "weightstream")
    out = subprocess.run([cli, "example", "ws-example"], cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return root, out.stdout


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, str]:
    """Random HF checkpoints written by ``save_pretrained``: the truth every test compares against."""
    from weightstream.models.presets import preset_config, save_random_checkpoint

    root = tmp_path_factory.mktemp("sources")
    out = {}
    for i, name in enumerate(FAMILIES):
        out[name] = save_random_checkpoint(preset_config(name), root / name, seed=10 + i)
    out["tiny-qwen3-bf16"] = save_random_checkpoint(
        preset_config("tiny-qwen3"), root / "tiny-qwen3-bf16", seed=99, dtype=torch.bfloat16
    )
    return out


def hf_logits(model_dir: str, input_ids: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(input_ids)).logits.float()
