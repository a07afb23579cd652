"""An engine serves only weights it loaded: started on a directory with only ``config.json``, or with an index
that lists part of the model, it refuses to serve (naming how many tensors were never loaded) until a complete
update, and then serves exactly the updated weights."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.workers import INPUT_IDS, Case, run_update
from tests.test_update import engine
from weightstream.engines import EngineError, ReferenceEngine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint


def _config_only(src: str, dst) -> str:
    dst.mkdir()
    shutil.copy(f"{src}/config.json", dst)
    return str(dst)


def _half_index(src: str, dst) -> tuple[str, int]:
    """The checkpoint's first half of tensors under an index that lists only them."""
    dst.mkdir()
    shutil.copy(f"{src}/config.json", dst)
    tensors = load_file(f"{src}/model.safetensors")
    kept = dict(sorted(tensors.items())[: len(tensors) // 2])
    save_file(kept, str(dst / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in kept.values())},
             "weight_map": {n: "model-00001-of-00001.safetensors" for n in kept}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(dst), len(tensors) - len(kept)


def test_engine_started_without_weights_refuses_until_a_complete_update(tmp_path):
    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=7)
    total = len(load_file(f"{src}/model.safetensors"))
    half, missing = _half_index(src, tmp_path / "half")
    for model_dir, never in ((_config_only(src, tmp_path / "empty"), total), (half, missing)):
        with engine(model_dir) as server:
            eng = ReferenceEngine(server.url, timeout_s=30)
            with pytest.raises(EngineError, match=f"{never} tensors were never loaded"):
                eng.logits(INPUT_IDS)
            with pytest.raises(EngineError, match=f"{never} tensors were never loaded"):
                eng.post("/generate", {"input_ids": INPUT_IDS, "sampling_params": {"max_new_tokens": 2}})
            launch(1, run_update, Case(src, Layout(1, 1)), [server.url], [{"transport": "broadcast"}])
            assert_logits_close(eng.logits(INPUT_IDS), hf_logits(src, INPUT_IDS))
