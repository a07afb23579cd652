"""The DTensor source: transformers models under FSDP2 (``fully_shard``, gloo), 1-D and 2-D (FSDP x TP)
meshes, streamed bit-identical to ``save_pretrained``'s checkpoint of the same model, and an update into
the reference engine whose logits then equal the HF model's."""

from __future__ import annotations

import torch

from tests.conftest import hf_logits
from tests.helpers.checks import INPUT_IDS, assert_logits_close
from weightstream.common.hf_files import CheckpointReader
from weightstream.converters.ops import FusedExperts, OpContext
from weightstream.converters.registry import get_converter, model_spec
from weightstream.engines import ReferenceEngine
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint
from weightstream.reference_engine.server import serve, stop
from weightstream.streaming.stream import stream_hf_weights

SMALL = 60_000


def _saved(src: str) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(src)
    with reader:
        return dict(reader.items())


def _check_stream(got: dict, want: dict[str, torch.Tensor], *, sharded: bool = False) -> None:
    assert set(got["tensors"]) == set(want), set(got["tensors"]) ^ set(want)
    bad = []
    for name, tensor in got["tensors"].items():
        ref = want[name]
        shard = got["shards"].get(name)
        if shard is not None:
            ref = ref.narrow(shard.dim, shard.start, shard.length)
        if tensor.dtype != ref.dtype or not torch.equal(tensor, ref):
            bad.append(name)
    assert not bad, f"not bit-identical: {bad}"
    assert bool(got["shards"]) == sharded


def test_fused_experts_round_trip():
    spec = model_spec(preset_config("tiny-qwen3-moe"))
    fused = torch.randn(spec.num_experts, 2 * 32, 64)
    op = FusedExperts(2)
    parts = op.to_hf(fused, OpContext(spec))
    assert len(parts) == 2 * spec.num_experts
    assert torch.equal(parts[2 * 3], fused[3, :32]) and torch.equal(parts[2 * 3 + 1], fused[3, 32:])
    assert torch.equal(op.to_megatron(parts, OpContext(spec), fused.shape), fused)
    resolved = get_converter("qwen3_moe").in_memory().resolve("model.layers.2.mlp.experts.down_proj", spec)
    assert resolved.hf_names[:2] == ("model.layers.2.mlp.experts.0.down_proj.weight",
                                     "model.layers.2.mlp.experts.1.down_proj.weight")


def test_plain_transformers_models_stream_as_saved(tmp_path):
    """No process group: a transformers model's parameters, fused experts included, stream exactly as
    ``save_pretrained`` writes them (names, dtypes, bits), tied embeddings once."""
    for i, name in enumerate(("tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe", "tiny-qwen2-moe")):
        model = random_hf_model(preset_config(name), seed=40 + i, dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / name)
        want = _saved(str(tmp_path / name))
        got = {"tensors": {}, "shards": {}}
        stream = stream_hf_weights(model, tmp_path / name, bucket_bytes=SMALL)
        for bucket in stream:
            got["tensors"].update({n: t.clone() for n, t in bucket.named_tensors()})
        _check_stream(got, want)
        assert stream.stats.unbatched == 0 and stream.stats.gathers == 0


def test_fsdp_1d_moe_and_unsharded_after_forward(tmp_path):
    moe = save_random_checkpoint(preset_config("tiny-qwen3-moe"), tmp_path / "moe", seed=51)
    dense = save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path / "dense", seed=52)
    cases = [("run_fsdp_stream", moe, (2,), ["full"]), ("run_fsdp_stream", dense, (2,), ["full"], True)]
    from tests.helpers.fsdp_workers import run_fsdp_cases

    results = launch(2, run_fsdp_cases, cases)
    want_moe, want_dense = _saved(moe), _saved(dense)
    for moe_out, dense_out in results:
        assert set(moe_out["placements"].values()) == {"(Shard(dim=0),)"}
        for got in (moe_out["full"], moe_out["again"]):
            _check_stream(got, want_moe)
            assert got["gathers"] > 0
        assert moe_out["full"]["planned"] and not moe_out["again"]["planned"]
        # After a forward without resharding, FSDP2 holds plain parameters: streamed in place, no gather.
        assert dense_out["plain_after_forward"]
        assert_logits_close(dense_out["logits"], hf_logits(dense, INPUT_IDS))
        _check_stream(dense_out["full"], want_dense)
        assert dense_out["full"]["gathers"] == 0


def test_fsdp_2d_tensor_parallel(tmp_path):
    """FSDP x TP on a (dp 2, tp 2) mesh: torch's TP plan on a dense model, and transformers' own TP and FSDP
    on an MoE model (its fused experts split over TP in two runs per rank: not one block)."""
    dense = save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path / "dense", seed=61)
    moe = save_random_checkpoint(preset_config("tiny-qwen3-moe"), tmp_path / "moe", seed=62)
    cases = [("run_fsdp_stream", dense, (2, 2), ["full", "per_rank"]),
             ("run_fsdp_stream", moe, ("hf", 2, 2), ["full", "per_rank"])]
    from tests.helpers.fsdp_workers import run_fsdp_cases

    results = launch(4, run_fsdp_cases, cases)
    want_dense, want_moe = _saved(dense), _saved(moe)
    for dense_out, moe_out in results:
        placements = set(dense_out["placements"].values()) | set(moe_out["placements"].values())
        assert any("_StridedShard" in p for p in placements)
        for out, want in ((dense_out, want_dense), (moe_out, want_moe)):
            _check_stream(out["full"], want)
            _check_stream(out["again"], want)
            _check_stream(out["per_rank"], want, sharded=True)
            assert not out["again"]["planned"]
        # Per rank: q_proj is this TP rank's half of the rows, as an engine of TP 2 holds it.
        shards = dense_out["per_rank"]["shards"]
        q = shards["model.layers.0.self_attn.q_proj.weight"]
        assert (q.dim, q.length * 2) == (0, q.full)


def test_fsdp_updates_into_engines(tmp_path):
    """``update_weights`` of FSDP2 models (2 ranks) into reference engines: Qwen3 by broadcast and by IPC,
    Qwen3-MoE (fused experts sharded over the ranks) by broadcast. The engines' logits then equal the HF
    models'; ``save_hf_checkpoint`` of each is bit-identical to its source."""
    from tests.helpers.fsdp_workers import run_fsdp_cases

    models = {"dense": ("tiny-qwen3", ["broadcast", "ipc"]), "moe": ("tiny-qwen3-moe", ["broadcast"])}
    srcs, servers, before = {}, {}, {}
    try:
        for i, (key, (preset, _)) in enumerate(models.items()):
            srcs[key] = save_random_checkpoint(preset_config(preset), tmp_path / f"{key}-src", seed=71 + 2 * i)
            start = save_random_checkpoint(preset_config(preset), tmp_path / f"{key}-engine", seed=72 + 2 * i)
            servers[key] = serve(start, 1)
            before[key] = ReferenceEngine(servers[key].url).logits(INPUT_IDS)
        cases = [("run_fsdp_update", srcs[k], (2,), servers[k].url, t, str(tmp_path / f"{k}-saved"))
                 for k, (_, t) in models.items()]
        results = launch(2, run_fsdp_cases, cases)
    finally:
        for server in servers.values():
            stop(server)
    for (key, (_, transports)), updates in zip(models.items(), results[0], strict=True):
        want = hf_logits(srcs[key], INPUT_IDS)
        assert (before[key] - want).abs().max() > 1e-2
        assert [u["report"].transport for u in updates] == transports
        for u in updates:
            assert u["report"].tensors == len(_saved(srcs[key]))
            assert_logits_close(u["engine_logits"], want)
        saved, source = _saved(str(tmp_path / f"{key}-saved")), _saved(srcs[key])
        assert set(saved) == set(source) and all(torch.equal(saved[n], source[n]) for n in source)


def test_kept_buffers_alternate_and_stay_exact(tmp_path):
    """``reuse_buffers``: bucket i is packed into kept buffer i % 2 (views made once), every stream of the
    model bit-identical to ``save_pretrained``; a bucket stays valid until bucket i + 2 is made."""
    model = random_hf_model(preset_config("tiny-qwen3-moe"), seed=45)
    model.save_pretrained(tmp_path / "m")
    want = _saved(str(tmp_path / "m"))
    for _ in range(3):
        got, ptrs, held = {"tensors": {}, "shards": {}}, [], {}
        stream = stream_hf_weights(model, tmp_path / "m", bucket_bytes=SMALL // 2, reuse_buffers=True)
        for bucket in stream:
            ptrs.append(bucket.buffer.data_ptr())
            got["tensors"].update({n: t.clone() for n, t in bucket.named_tensors()})
            held[bucket.index] = bucket
            if bucket.index >= 1:  # the previous bucket is still intact while this one is made
                prev = held.pop(bucket.index - 1)
                assert all(torch.equal(t, want[n]) for n, t in prev.named_tensors())
        _check_stream(got, want)
        assert len(stream) > 4 and len(set(ptrs)) == 2 and ptrs[0] == ptrs[2] != ptrs[1]
