"""Qwen MoE declarations, features, the HF checkpoint names, the global table over expert-parallel
ranks, and bucket plans over many small experts (no processes)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from safetensors import safe_open

from weightstream.common.layout import ALIGN
from weightstream.converters import NotRepresentable, OpContext, get_converter
from weightstream.converters.expected import expected_hf_shapes
from weightstream.converters.registry import model_spec
from weightstream.errors import ConversionError
from weightstream.models.presets import preset_config, random_hf_model
from weightstream.models.spec import ModelSpec
from weightstream.sources.table import RankMeta, build_table
from weightstream.streaming.plan import plan_buckets

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset


def _cfg(name: str, **overrides):
    cfg = preset_config(name)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def test_features_follow_the_hf_config_layer_by_layer():
    s2 = model_spec(preset_config("tiny-qwen2-moe"))
    assert (s2.num_experts, s2.moe_top_k, s2.moe_intermediate_size,
            s2.shared_expert_intermediate_size) == (8, 2, 32, 48)
    assert (s2.qkv_bias, s2.qk_norm, s2.norm_topk_prob, s2.dense_layers) == (True, False, False, frozenset({1}))
    assert [s2.is_moe_layer(i) for i in range(4)] == [True, False, True, True]
    s3 = model_spec(preset_config("tiny-qwen3-moe"))
    assert (s3.qkv_bias, s3.qk_norm, s3.norm_topk_prob, s3.shared_expert_intermediate_size) == (False, True, True, 0)
    assert s3.dense_layers == frozenset()
    # decoder_sparse_step: layer i is MoE when (i + 1) % step == 0, and not in mlp_only_layers.
    s = model_spec(_cfg("tiny-qwen3-moe", decoder_sparse_step=2, mlp_only_layers=[3]))
    assert s.dense_layers == frozenset({0, 2, 3})
    big = model_spec(preset_config("qwen3-30b-a3b"))
    assert (big.num_experts, big.moe_top_k, big.moe_intermediate_size, big.num_layers,
            big.head_dim) == (128, 8, 768, 48, 128)


def test_bad_moe_configs_list_every_problem():
    with pytest.raises(ValueError) as err:
        model_spec(_cfg("tiny-qwen3-moe", num_experts_per_tok=9, moe_intermediate_size=0,
                                      mlp_only_layers=[0, 1, 2, 3]))
    text = str(err.value)
    assert "experts per token (9)" in text and "moe_intermediate_size" in text and "every layer is dense" in text


def test_both_expert_namings_resolve_to_the_checkpoint_names():
    spec = model_spec(preset_config("tiny-qwen3-moe"))
    conv = get_converter("qwen3_moe")
    for fc1, fc2 in (
        ("decoder.layers.3.mlp.experts.local_experts.6.linear_fc1.weight",
         "decoder.layers.3.mlp.experts.local_experts.6.linear_fc2.weight"),
        ("decoder.layers.3.mlp.experts.linear_fc1.weight6", "decoder.layers.3.mlp.experts.linear_fc2.weight6"),
    ):
        r1, r2 = conv.resolve(fc1, spec), conv.resolve(fc2, spec)
        assert r1.hf_names == ("model.layers.3.mlp.experts.6.gate_proj.weight",
                               "model.layers.3.mlp.experts.6.up_proj.weight")
        assert r2.hf_names == ("model.layers.3.mlp.experts.6.down_proj.weight",)
        # Split over expert-TP (not dense TP); fc2 on dim 1 whatever Megatron reports for grouped fc2.
        assert (r1.mapping.tp_group, r1.mapping.tp_dim, r2.mapping.tp_group, r2.mapping.tp_dim) == ("etp", 0, "etp", 1)
    router = conv.resolve("decoder.layers.0.mlp.router.weight", spec)
    assert router.hf_names == ("model.layers.0.mlp.gate.weight",) and router.mapping.tp_dim is None
    assert conv.resolve("decoder.layers.0.mlp.shared_experts.gate_weight", spec) is None  # Qwen3-MoE has none


def test_qwen2_moe_shared_expert_and_families_share_declarations():
    spec = model_spec(preset_config("tiny-qwen2-moe"))
    conv = get_converter("qwen2_moe")
    assert conv.resolve("decoder.layers.2.mlp.shared_experts.linear_fc1.weight", spec).hf_names == (
        "model.layers.2.mlp.shared_expert.gate_proj.weight", "model.layers.2.mlp.shared_expert.up_proj.weight",
    )
    fc2 = conv.resolve("decoder.layers.2.mlp.shared_experts.linear_fc2.weight", spec)
    assert fc2.hf_names == ("model.layers.2.mlp.shared_expert.down_proj.weight",) and fc2.mapping.tp_group == "tp"
    assert conv.resolve("decoder.layers.2.mlp.shared_experts.gate_weight", spec).hf_names == (
        "model.layers.2.mlp.shared_expert_gate.weight",
    )
    # A dense layer of an MoE model converts through the dense declarations.
    dense_fc2 = conv.resolve("decoder.layers.1.mlp.linear_fc2.weight", spec)
    assert dense_fc2.hf_names == ("model.layers.1.mlp.down_proj.weight",)
    # Each MoE family is its dense family plus expert declarations, shared by reference.
    for moe, dense in (("qwen2_moe", "qwen2"), ("qwen3_moe", "qwen3")):
        dense_mappings = get_converter(dense).mappings
        assert get_converter(moe).mappings[: len(dense_mappings)] == dense_mappings
    extra2 = {m.megatron for m in get_converter("qwen2_moe").mappings[len(get_converter("qwen2").mappings):]}
    extra3 = {m.megatron for m in get_converter("qwen3_moe").mappings[len(get_converter("qwen3").mappings):]}
    assert extra2 - extra3 == {
        "decoder.layers.*.mlp.shared_experts.linear_fc1.weight",
        "decoder.layers.*.mlp.shared_experts.linear_fc2.weight",
        "decoder.layers.*.mlp.shared_experts.gate_weight",
    }
    assert extra3 < extra2


def test_expert_bias_is_refused_not_dropped():
    spec = model_spec(preset_config("tiny-qwen3-moe"))
    resolved = get_converter("qwen3_moe").resolve("decoder.layers.0.mlp.router.expert_bias", spec)
    assert resolved.hf_names == ()
    with pytest.raises(NotRepresentable, match="e_score_correction_bias"):
        resolved.mapping.op.to_hf(torch.zeros(8), OpContext(spec))
    with pytest.raises(NotRepresentable):
        resolved.mapping.op.to_megatron([], OpContext(spec), torch.Size([8]))


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-qwen3-moe"])
def test_expected_names_are_what_save_pretrained_writes(preset, tmp_path):
    """transformers 5 fuses experts in memory; the checkpoint (and our names) hold one tensor per expert."""
    cfg = preset_config(preset)
    random_hf_model(cfg, seed=1).save_pretrained(tmp_path)
    written = {}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        for k in f.keys():
            written[k] = tuple(f.get_slice(k).get_shape())
    assert expected_hf_shapes(cfg) == written
    assert written["model.layers.0.mlp.experts.7.gate_proj.weight"] == (32, 64)
    assert written["model.layers.0.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert not any("gate_up_proj" in k for k in written)


# -- the global table over expert-parallel ranks, from metadata as ranks report it --------------


def _moe_listing(spec: ModelSpec, *, ep: int, ep_rank: int, etp: int = 1, grouped: bool = False,
                 global_ids: bool = True, dtype: str = "float32", padded_vocab: int = 1024) -> list[tuple]:
    """(name, local shape, dtype, expert) as a Megatron-Core rank reports them (local spec, TP 1)."""
    h, hd = spec.hidden_size, spec.head_dim
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * hd
    per_rank = spec.num_experts // ep
    out = [("embedding.word_embeddings.weight", (padded_vocab, h), False)]
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), False),
                (p + "self_attention.linear_proj.weight", (h, spec.num_attention_heads * hd), False),
                (p + "self_attention.linear_qkv.weight", (qkv, h), False)]
        if spec.qkv_bias:
            out.append((p + "self_attention.linear_qkv.bias", (qkv,), False))
        if spec.qk_norm:
            out += [(p + "self_attention.q_layernorm.weight", (hd,), False),
                    (p + "self_attention.k_layernorm.weight", (hd,), False)]
        out.append((p + "pre_mlp_layernorm.weight", (h,), False))
        if not spec.is_moe_layer(i):
            out += [(p + "mlp.linear_fc1.weight", (2 * spec.intermediate_size, h), False),
                    (p + "mlp.linear_fc2.weight", (h, spec.intermediate_size), False)]
            continue
        out.append((p + "mlp.router.weight", (spec.num_experts, h), False))
        ffn = spec.moe_intermediate_size // etp
        for e in range(per_rank):
            g = ep_rank * per_rank + e if global_ids else e
            if grouped:
                names = (f"{p}mlp.experts.linear_fc1.weight{g}", f"{p}mlp.experts.linear_fc2.weight{g}")
            else:
                names = (f"{p}mlp.experts.local_experts.{g}.linear_fc1.weight",
                         f"{p}mlp.experts.local_experts.{g}.linear_fc2.weight")
            out += [(names[0], (2 * ffn, h), True), (names[1], (h, ffn), True)]
        if spec.shared_expert_intermediate_size:
            s = spec.shared_expert_intermediate_size
            out += [(p + "mlp.shared_experts.gate_weight", (1, h), False),
                    (p + "mlp.shared_experts.linear_fc1.weight", (2 * s, h), False),
                    (p + "mlp.shared_experts.linear_fc2.weight", (h, s), False)]
    out += [("decoder.final_layernorm.weight", (h,), False), ("output_layer.weight", (padded_vocab, h), False)]
    return [(n, shape, dtype, expert) for n, shape, expert in out]


def _ep_table(cfg, *, ep: int, etp: int = 1, **kw):
    spec = model_spec(cfg)
    # Ranks as Megatron numbers them (TP 1): EP rank r, expert-TP rank t.
    ranks = [
        RankMeta(0, 0, r, t, tuple(_moe_listing(spec, ep=ep, ep_rank=r, etp=etp, **kw)))
        for r in range(ep) for t in range(etp)
    ]
    return build_table(ranks, get_converter(spec.model_type), spec, expected_hf_shapes(cfg), tp_size=1, etp_size=etp)


@pytest.mark.parametrize("grouped", [False, True])
def test_table_over_ep_and_expert_tp_covers_every_expert_once(grouped):
    cfg = preset_config("tiny-qwen2-moe")
    table = _ep_table(cfg, ep=4, etp=2, grouped=grouped)
    names = [o.name for e in table for o in e.outputs]
    assert len(names) == len(set(names)) and sorted(names) == sorted(expected_hf_shapes(cfg))
    experts = [e for e in table if e.ep_owner is not None]
    assert len(experts) == 3 * 8 * 2  # 3 MoE layers, 8 experts, fc1 + fc2
    for e in experts:
        index = int(e.outputs[0].name.split(".experts.")[1].split(".")[0])
        assert e.ep_owner == index // 2  # 8 experts over EP 4
        assert (e.group, e.parts) == ("etp", 2)
        assert e.full_shape == ((64, 64) if "fc1" in e.name else (64, 32))
    shared = next(e for e in table if e.name.endswith("0.mlp.shared_experts.linear_fc1.weight"))
    assert (shared.ep_owner, shared.group, shared.parts) == (None, "tp", 1)
    # Within a layer the experts come in global order, so each EP owner's run is contiguous.
    layer0 = [e.ep_owner for e in table if e.name.startswith("decoder.layers.0.") and e.ep_owner is not None]
    assert layer0 == sorted(layer0)


def test_local_expert_ids_reported_as_global_are_caught():
    cfg = preset_config("tiny-qwen3-moe")
    with pytest.raises(ConversionError) as err:
        _ep_table(cfg, ep=2, global_ids=False)
    problems = err.value.problems
    doubled = problems["experts held by several expert-parallel ranks (local expert ids reported as global?)"]
    assert len(doubled) == 4 * 4 * 2
    assert "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight: EP ranks [0, 1]" in doubled
    # Experts 4..7 nowhere; experts 0..3 refused rather than taken from an arbitrary rank.
    missing = problems["HF tensors the model does not provide"]
    assert len(missing) == 4 * 8 * 3 and "model.layers.3.mlp.experts.7.down_proj.weight" in missing


def test_expert_bias_in_the_table_is_named_with_its_reason():
    cfg = preset_config("tiny-qwen3-moe")
    spec = model_spec(cfg)
    listing = _moe_listing(spec, ep=1, ep_rank=0)
    listing.append(("decoder.layers.2.mlp.router.expert_bias", (8,), "float32", False))
    listing.append(("decoder.layers.2.mlp.router.mystery", (8,), "float32", False))
    with pytest.raises(ConversionError) as err:
        build_table([RankMeta(0, 0, 0, 0, tuple(listing))], get_converter("qwen3_moe"), spec, expected_hf_shapes(cfg),
                    tp_size=1)
    problems = err.value.problems
    (refused,) = problems["Megatron tensors the HF model has no place for"]
    assert refused.startswith("decoder.layers.2.mlp.router.expert_bias: ")
    assert "moe_router_enable_expert_bias" in refused
    assert problems["Megatron tensors no mapping covers"] == ["decoder.layers.2.mlp.router.mystery"]


def test_qwen3_30b_a3b_plan_packs_many_experts_per_bucket():
    """The real Qwen3-30B-A3B shape in bf16 under EP 8: 18,867 HF tensors, most of them 3 MiB experts.
    The plan the stream makes keeps every bucket within its bound and packs experts by the hundred,
    so per-tensor overhead does not dominate a sync."""
    cfg = preset_config("qwen3-30b-a3b")
    table = _ep_table(cfg, ep=8, dtype="bfloat16", padded_vocab=151936)
    outputs = [[o.nbytes for o in e.outputs] for e in table]
    assert sum(len(o) for o in outputs) == 18867
    limit = 512 << 20
    plan = plan_buckets(outputs, limit, ALIGN)
    counts = [sum(len(outputs[i]) for i in bp.items) for bp in plan]
    assert sum(counts) == 18867
    oversize = [bp for bp in plan if bp.nbytes > limit]
    # Only the embedding and lm_head (151936 x 2048 bf16 = 594 MiB each) exceed the bound, each alone.
    assert [len(bp.items) for bp in oversize] == [1, 1]
    # 61 GB in 115 buckets: the embedding alone, then buckets of 167-170 tensors (512 MiB / 3 MiB
    # experts, a layer's attention riding along), a short tail, and lm_head alone.
    assert len(plan) == 115 and counts[0] == counts[-1] == 1
    assert min(counts[1:-2]) >= 160 and statistics.median(counts) >= 169
    expert_only = [bp for bp in plan if all(table[i].ep_owner is not None for i in bp.items)]
    assert len(expert_only) >= 60


def test_qwen3_235b_a22b_shapes_and_plan():
    """Qwen3-235B-A22B's real shapes (random weights for ``weightstream bench``; the byte counts of
    tools/multinode_model.py): 36,945 HF tensors, 235.09 B parameters, 470.2 GB in bf16; 512 MiB buckets hold
    every tensor but the embedding and lm_head (1.24 GB each, alone): 888 buckets. Block FP8 quantizes the
    attention projections and the experts (36,472 tensors), not the routers."""
    cfg = preset_config("qwen3-235b-a22b")
    spec = model_spec(cfg)
    assert (spec.num_experts, spec.moe_top_k, spec.moe_intermediate_size, spec.num_layers, spec.head_dim,
            spec.norm_topk_prob, spec.qk_norm, spec.dense_layers) == (128, 8, 1536, 94, 128, True, True, frozenset())
    shapes = expected_hf_shapes(cfg)
    # Per layer: q/k/v/o, q/k norms, two layer norms, the router, 128 experts of three; then embedding, norm, lm_head.
    assert len(shapes) == 94 * (4 + 2 + 2 + 1 + 3 * 128) + 3 == 36945
    assert sum(math.prod(s) for s in shapes.values()) == 235_093_634_560
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (64 * 128, 4096)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (4 * 128, 4096)
    assert shapes["model.layers.93.mlp.experts.127.gate_proj.weight"] == (1536, 4096)
    assert shapes["model.layers.93.mlp.experts.127.down_proj.weight"] == (4096, 1536)
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 4096)
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (151936, 4096)
    plan = plan_buckets([[math.prod(s) * 2] for s in shapes.values()], 512 << 20, ALIGN)
    assert [(len(bp.items), bp.nbytes) for bp in plan if bp.nbytes > 512 << 20] == [(1, 151936 * 4096 * 2)] * 2
    assert len(plan) == 888
    conv = get_converter("qwen3_moe")
    assert len([n for n in shapes if conv.quantizes(n)]) == 94 * (4 + 3 * 128)
