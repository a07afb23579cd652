import os
import warnings

import pytest
import torch

os.environ.setdefault("PYTHONWARNINGS", "ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

FAMILIES = ("tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied")


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
