"""Per-rank mode of DeepSeek-V3 in Megatron-Core's local spec at TP 2 (a real MLA model, a real gloo job): the
multi-latent attention's down projections, which Megatron splits over TP there and every engine holds whole, come
whole on every rank (gathered), bit-identical to the HF checkpoint; every other tensor comes as the rank's own shard.
Per-rank P2P then updates an engine at TP 2 that does not declare its layout (no resharding): it loads every
bucket as sent and gives HF's logits."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close, assert_per_rank_assembles
from tests.helpers.faults import hide_capabilities
from tests.helpers.fp8_truth import same_bits
from tests.helpers.mla_per_rank import run_per_rank_then_update
from tests.helpers.workers import INPUT_IDS, Case
from weightstream.common.hf_files import CheckpointReader
from weightstream.engines.base import RESHARD
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.reference_engine.server import serve, stop

WHOLE = ("q_a_proj", "kv_a_proj_with_mqa")  # held whole by every engine, split over TP by the local spec


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("deepseek_v3_per_rank")
    cfg = preset_config("tiny-deepseek-v3")
    return save_random_checkpoint(cfg, root / "src", seed=91), save_random_checkpoint(cfg, root / "engine", seed=92)


def test_per_rank_tp2_yields_mla_down_projections_whole(checkpoints):
    src, engine_start = checkpoints
    server = serve(engine_start, 2)
    try:
        hide_capabilities(server, (RESHARD,))  # per-rank buckets go to engine rank r as trainer rank r yields them
        results = launch(2, run_per_rank_then_update, Case(src, Layout(2, 1), mode="per_rank"), server.url)
    finally:
        stop(server)
    cases = [r["case"] for r in results]
    whole = [(r["tp_rank"], name, shard, t) for r in cases for name, shard, t in r["shards"]
             if any(f".self_attn.{w}.weight" in name for w in WHOLE)]
    assert len(whole) == 2 * 2 * 4  # both ranks, both projections, every layer
    with CheckpointReader(src) as truth:
        wrong = [(rank, name) for rank, name, shard, t in whole
                 if shard is not None or not same_bits(t, truth.get(name))]
    assert wrong == []
    assert_per_rank_assembles(cases, src, tp=2)  # and every other tensor: the ranks' shards make the checkpoint's
    [update] = results[0]["update"]
    report = update["report"]
    assert report.transport == "p2p" and report.mode == "per_rank" and "resharded" not in report.reason, report.reason
    assert_logits_close(update["engine_logits"], hf_logits(src, INPUT_IDS), atol=1e-5)
    assert torch.isfinite(update["engine_logits"]).all()
