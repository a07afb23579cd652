"""Memory release around colocated updates: the engine frees its weights while the trainer trains (its
memory measurably drops, and it refuses to serve), and the next update re-creates and refills them;
generation is then exactly the HF model's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.workers import INPUT_IDS, Case, run_release_cycle
from tests.test_update import engine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import save_random_checkpoint

# Big enough that its tensors are mapped memory the allocator gives back (a few MB), small enough for CI.
CONFIG = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)


def _greedy(model_dir: str, ids: list[int], n: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.mark.parametrize("how", ["buffers", "direct"])
def test_release_then_update_recreates_the_weights(tmp_path, how):
    """``buffers``: checksummed buckets the engine copies in. ``direct``: an update first writes straight into
    the engine's weights (mapped into the trainer), so releasing them must make the trainer let go of them
    first; the next update writes into the re-created weights."""
    cfg = Qwen3Config(**CONFIG)
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=61)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=62)
    options = {"checksums": True} if how == "buffers" else {}
    with engine(eng_dir, tp=1) as server:
        (out,) = launch(1, run_release_cycle, Case(src, Layout(1, 1)), server.url, "ipc", options, how == "direct")
    (before,), (released,), (after,) = out["before"], out["released"], out["after"]
    weights = sum(t.numel() * t.element_size() for t in AutoModelForCausalLM.from_pretrained(eng_dir).parameters())
    dropped = before["rss_bytes"] - released["rss_bytes"]
    print(f"engine RSS {before['rss_bytes'] / 2**20:.1f} MB -> released {released['rss_bytes'] / 2**20:.1f} MB "
          f"-> after the update {after['rss_bytes'] / 2**20:.1f} MB (weights {weights / 2**20:.1f} MB)")
    assert dropped >= 0.7 * weights, (dropped, weights)
    assert after["rss_bytes"] - released["rss_bytes"] >= 0.7 * weights
    assert "released" in out["served_while_released"]
    assert out["report"].weight_version == "after-release" and out["report"].transport == "ipc"
    assert out["report"].direct == (how == "direct")
    if how == "direct":
        assert out["first"].direct and out["first"].weight_version == "first"
    assert_logits_close(out["logits"], hf_logits(src, INPUT_IDS))
    assert out["generated"] == _greedy(src, INPUT_IDS[0], 4)
