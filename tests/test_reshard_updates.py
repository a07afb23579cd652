"""Resharded P2P updates: a real Megatron-Core trainer (gloo job) into a real reference engine of another TP
(or EP), each trainer rank sending each engine rank only the rows and columns it needs; the engine then serves
bit for bit what an engine started on the trainer's checkpoint serves, and the HF model's logits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import assert_experts_held_by_owners, assert_logits_close, expert_checksums
from tests.helpers.fp8_workers import run_fp8_updates
from tests.helpers.workers import INPUT_IDS, Case, run_update
from weightstream.common.hf_files import CheckpointReader
from weightstream.engines import ReferenceEngine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.reference_engine.server import serve, stop

SMALL = 120_000  # bytes per bucket: the tiny models travel in several buckets


def _served(model_dir: str, tp: int, ep: int = 1) -> torch.Tensor:
    """The logits of an engine of TP ``tp`` (and EP ``ep``) started on ``model_dir`` (what an update must make it
    serve)."""
    server = serve(model_dir, tp, ep=ep)
    try:
        return ReferenceEngine(server.url).logits(INPUT_IDS)
    finally:
        stop(server)


def _update(src: str, engine_dir: str, layout: Layout, engine_tp: int, engine_ep: int = 1,
            **options) -> tuple[list, torch.Tensor]:
    """One ``auto`` update of an engine of TP ``engine_tp`` and EP ``engine_ep`` (started on other weights) from a
    trainer of ``layout``: every rank's report, and the engine's logits after it."""
    reports, after, _ = _update_and_read(src, engine_dir, layout, engine_tp, engine_ep, (), **options)
    return reports, after


def _update_and_read(src: str, engine_dir: str, layout: Layout, engine_tp: int, engine_ep: int,
                     names: Sequence[str], **options) -> tuple[list, torch.Tensor, list[dict[str, str]]]:
    """:func:`_update`, and after it the checksums of what each engine rank holds of ``names``."""
    server = serve(engine_dir, engine_tp, ep=engine_ep)
    try:
        before = ReferenceEngine(server.url).logits(INPUT_IDS)
        results = launch(layout.tp * layout.pp * layout.ep, run_update, Case(src, layout), [server.url],
                         [{"transport": "auto", "bucket_bytes": SMALL, **options}])
        after = ReferenceEngine(server.url).logits(INPUT_IDS)
        held = ReferenceEngine(server.url).weight_checksums(names) if names else []
    finally:
        stop(server)
    for rank_results in results:
        for r in rank_results:
            assert "error" not in r, r["error"]
    assert (after - before).abs().max() > 1e-2  # the update changed what it serves
    return [rank_results[0]["report"] for rank_results in results], after, held


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
    them whole on each rank. The per-rank stream gathers those (the only gathers) and yields them whole on both
    trainer ranks; every engine rank takes them from one of them (and its own rank's shards of the rest), and serves
    what the checkpoint holds."""
    cfg = preset_config("tiny-deepseek-v3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=51)
    reports, logits = _update(src, save_random_checkpoint(cfg, tmp_path / "eng", seed=52), Layout(2, 1), 2)
    assert reports[0].transport == "p2p" and "engine TP 2, trainer TP 2" in reports[0].reason
    assert all(r.gathers > 0 for r in reports) and len({r.gathers for r in reports}) == 1
    assert torch.equal(logits, _served(src, 2))
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("reshard_moe")
    cfg = preset_config("tiny-qwen3-moe")
    return save_random_checkpoint(cfg, root / "src", seed=41), save_random_checkpoint(cfg, root / "eng", seed=42)


@pytest.mark.parametrize("layout", [Layout(1, 1, ep=2), Layout(2, 1)], ids=["trainer-ep2", "trainer-tp2"])
def test_resharded_p2p_into_an_engine_with_expert_parallelism(moe, layout):
    """Qwen3-MoE into an engine at TP 2 with EP 2 (each rank its four experts whole, attention split): from a trainer
    at EP 2 (each EP rank sends its experts to the engine rank that owns them) and at TP 2 (each TP rank sends its
    slice of every expert to the expert's owner). Each engine rank then holds exactly its experts, bit for bit the
    trainer's, and serves what an EP engine started on the trainer's checkpoint serves, the HF model's logits."""
    src, engine_dir = moe
    want = expert_checksums(src)
    reports, logits, held = _update_and_read(src, engine_dir, layout, 2, 2, list(want))
    rep = reports[0]
    assert rep.transport == "p2p" and "resharded P2P" in rep.reason and "engine TP 2 EP 2" in rep.reason
    assert rep.tensors == 135 and all(r.gathers == 0 for r in reports)
    assert_experts_held_by_owners(held, want, 2)
    assert torch.equal(logits, _served(src, 2, ep=2))
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))


def test_broadcast_and_ipc_into_an_engine_with_expert_parallelism(moe, tmp_path):
    """A trainer at TP 2 broadcasts (and, colocated, hands by IPC) whole buckets to engines at TP 2 with EP 2: each
    engine rank loads its experts and passes over the others'; each then holds exactly its experts, bit for bit, and
    serves what an EP engine started on the trainer's checkpoint serves."""
    src, engine_dir = moe
    want = expert_checksums(src)
    servers = [serve(engine_dir, 2, ep=2), serve(engine_dir, 2, ep=2)]
    try:
        before = ReferenceEngine(servers[0].url).logits(INPUT_IDS)
        results = launch(2, run_fp8_updates, Case(src, Layout(2, 1), bucket_bytes=SMALL),
                         [(servers[0].url, {"transport": "broadcast"}), (servers[1].url, {"transport": "ipc"})],
                         str(Path(tmp_path, "saved")))
        held = [ReferenceEngine(s.url).weight_checksums(list(want)) for s in servers]
    finally:
        for s in servers:
            stop(s)
    steps = results[0]
    assert [e.get("error") for e in steps] == [None, None]
    assert [e["report"].transport for e in steps] == ["broadcast", "ipc"]
    served = _served(src, 2, ep=2)
    for entry, ranks in zip(steps, held, strict=True):
        assert_experts_held_by_owners(ranks, want, 2)
        assert torch.equal(entry["logits"], served)
    assert (served - before).abs().max() > 1e-2


def test_an_expert_parallel_rank_takes_its_experts_and_refuses_what_nobody_holds(moe):
    """An engine rank at EP 2 (its model alone, no group): from whole tensors it loads its own experts and passes over
    those rank 1 owns; a shard of one of those, and a name no rank holds, are refused, each named."""
    from transformers import AutoConfig

    from weightstream.reference_engine.model import ShardedCausalLM
    from weightstream.streaming.bucket import Shard

    src, _ = moe
    model = ShardedCausalLM(AutoConfig.from_pretrained(src), 0, 2, None, torch.device("cpu"), ep=2)
    with CheckpointReader(src) as reader:
        whole = {n: reader.get(n) for n in reader.keys()}
    mine, theirs = "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.experts.4.down_proj.weight"
    assert model.elsewhere[theirs] == 1 and theirs not in model.params and mine in model.params
    report = model.load_weights((n, t, None) for n, t in whole.items())
    assert report.problems == [] and mine in report.loaded and theirs not in report.loaded
    assert torch.equal(model.params[mine][0], whole[mine])
    assert model.owners() == {**dict.fromkeys((n for n in whole if ".mlp.experts." in n and n not in model.elsewhere),
                                              0), **model.elsewhere}
    half = whole[theirs][:, :16]
    report = model.load_weights([(theirs, half, Shard(1, 0, 16, 32)), ("model.layers.9.mlp.gate.weight", half, None)])
    assert report.problems == [f"{theirs}: a shard Shard(dim=1, start=0, length=16, full=32) of a tensor engine rank 1 "
                               "holds alone, whole", "model.layers.9.mlp.gate.weight: the model has no such tensor"]
