"""Resharded P2P updates: a real Megatron-Core trainer (gloo job) into a real reference engine of another TP
(or EP), each trainer rank sending each engine rank only the rows and columns it needs; the engine then serves
bit for bit what an engine started on the trainer's checkpoint serves, and the HF model's logits."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.workers import INPUT_IDS, Case, run_update
from weightstream.engines import ReferenceEngine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.reference_engine.server import serve, stop

SMALL = 120_000  # bytes per bucket: the tiny models travel in several buckets


def _served(model_dir: str, tp: int) -> torch.Tensor:
    """The logits of an engine of TP ``tp`` started on ``model_dir`` (what an update must make it serve)."""
    server = serve(model_dir, tp)
    try:
        return ReferenceEngine(server.url).logits(INPUT_IDS)
    finally:
        stop(server)


def _update(src: str, engine_dir: str, layout: Layout, engine_tp: int, **options) -> tuple[list, torch.Tensor]:
    """One ``auto`` update of an engine of TP ``engine_tp`` (started on other weights) from a trainer of
    ``layout``: every rank's report, and the engine's logits after it."""
    server = serve(engine_dir, engine_tp)
    try:
        before = ReferenceEngine(server.url).logits(INPUT_IDS)
        results = launch(layout.tp * layout.pp * layout.ep, run_update, Case(src, layout), [server.url],
                         [{"transport": "auto", "bucket_bytes": SMALL, **options}])
        after = ReferenceEngine(server.url).logits(INPUT_IDS)
    finally:
        stop(server)
    for rank_results in results:
        for r in rank_results:
            assert "error" not in r, r["error"]
    assert (after - before).abs().max() > 1e-2  # the update changed what it serves
    return [rank_results[0]["report"] for rank_results in results], after


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("reshard")
    cfg = preset_config("tiny-qwen3")
    return save_random_checkpoint(cfg, root / "src", seed=31), save_random_checkpoint(cfg, root / "eng", seed=32)


@pytest.mark.parametrize("trainer_tp,engine_tp", [(2, 1), (1, 2)])
def test_resharded_p2p_between_tp_sizes(dense, trainer_tp, engine_tp):
    src, engine_dir = dense
    reports, logits = _update(src, engine_dir, Layout(trainer_tp, 1), engine_tp)
    rep = reports[0]
    assert rep.transport == "p2p" and rep.mode == "per_rank" and "resharded P2P" in rep.reason
    assert f"engine TP {engine_tp}, trainer TP {trainer_tp}" in rep.reason
    assert all(r.gathers == 0 for r in reports)  # no all-gather on any trainer rank
    assert rep.tensors == 47
    assert rep.metadata_ahead  # every bucket's routes told in one request, then the buckets back to back
    assert torch.equal(logits, _served(src, engine_tp))
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))


def test_resharded_p2p_from_two_pipeline_stages(dense):
    """TP 2 x PP 2 into one engine rank: the first stage's two TP ranks send (the second stage's tensors reach them
    within the job, as in every per-rank stream); the second stage's ranks send nothing."""
    src, engine_dir = dense
    reports, logits = _update(src, engine_dir, Layout(2, 2), 1)
    assert reports[0].transport == "p2p" and "engine TP 1, trainer TP 2" in reports[0].reason
    assert reports[0].tensors == 47
    assert torch.equal(logits, _served(src, 1))


def test_resharded_p2p_tp2_into_tp4(dense):
    """Two trainer ranks, four engine ranks: each engine rank hears the one trainer rank that holds its rows."""
    src, engine_dir = dense
    reports, logits = _update(src, engine_dir, Layout(2, 1), 4, checksums=True)
    assert reports[0].transport == "p2p" and "engine TP 4, trainer TP 2" in reports[0].reason
    assert torch.equal(logits, _served(src, 4))
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))


def test_resharded_p2p_moe_ep2_into_one_engine_rank(tmp_path):
    """Qwen3-MoE trained with EP 2: each EP rank sends its own experts, the dense tensors come from one of them."""
    cfg = preset_config("tiny-qwen3-moe")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=41)
    reports, logits = _update(src, save_random_checkpoint(cfg, tmp_path / "eng", seed=42), Layout(1, 1, ep=2), 1)
    assert reports[0].transport == "p2p" and "trainer TP 1 EP 2" in reports[0].reason and reports[0].tensors == 135
    assert all(r.gathers == 0 for r in reports)
    assert torch.equal(logits, _served(src, 1))
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))


def test_deepseek_v3_mla_down_projections_assembled_at_equal_tp(tmp_path):
    """DeepSeek-V3 in Megatron's local spec at TP 2 holds the MLA down projections split by rows; the engine holds
    them whole on each rank. At equal TP the plan is then not rank r to rank r: every engine rank takes the two
    trainer ranks' rows of those (and its own rank's shards of the rest), and serves what the checkpoint holds."""
    cfg = preset_config("tiny-deepseek-v3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=51)
    reports, logits = _update(src, save_random_checkpoint(cfg, tmp_path / "eng", seed=52), Layout(2, 1), 2)
    assert reports[0].transport == "p2p" and "engine TP 2, trainer TP 2" in reports[0].reason
    assert all(r.gathers == 0 for r in reports)
    assert torch.equal(logits, _served(src, 2))
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))
