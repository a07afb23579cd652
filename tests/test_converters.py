"""Declarations, the pattern language, the registry, and the global table's checks (no processes)."""

from __future__ import annotations

import math

import pytest

import weightstream as ws
from weightstream.converters import IDENTITY, QKV, Mapping, get_converter, known_model_types, register_converter
from weightstream.converters.expected import expected_hf_shapes
from weightstream.converters.mapping import compile_pattern, fill_pattern
from weightstream.converters.registry import model_spec, unregister_converter
from weightstream.errors import ConversionError, UnknownModelError
from weightstream.models.presets import preset_config
from weightstream.sources.table import RankMeta, build_table

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset


def test_pattern_language():
    rx = compile_pattern("decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight")
    assert rx.match("decoder.layers.12.mlp.experts.local_experts.3.linear_fc1.weight").groups() == ("12", "3")
    assert rx.match("decoder.layers.x.mlp.experts.local_experts.3.linear_fc1.weight") is None
    assert compile_pattern("**.weight").match("a.b.c.weight").groups() == ("a.b.c",)
    assert fill_pattern("model.layers.*.mlp.experts.*.up_proj.weight", ("12", "3")) == (
        "model.layers.12.mlp.experts.3.up_proj.weight"
    )


def test_registry_is_loud():
    assert {"qwen2", "qwen3"} <= set(known_model_types())
    with pytest.raises(UnknownModelError) as err:
        get_converter("no_such_model")
    assert "qwen2" in str(err.value) and "qwen3" in str(err.value)
    with pytest.raises(ValueError, match="already registered"):
        register_converter("qwen3", get_converter("qwen2").derive("qwen3"))


def test_register_a_new_model_with_the_decorator():
    @register_converter("my_qwen")
    def my_qwen() -> ws.Converter:
        return get_converter("qwen3").derive(
            "my_qwen",
            add=[Mapping("decoder.layers.*.self_attention.extra.weight", "model.layers.*.self_attn.extra.weight")],
        )

    try:
        conv = get_converter("my_qwen")
        assert conv.model_type == "my_qwen"
        spec = model_spec(preset_config("tiny-qwen3"))
        r = conv.resolve("decoder.layers.7.self_attention.extra.weight", spec)
        assert r.hf_names == ("model.layers.7.self_attn.extra.weight",) and r.mapping.op is IDENTITY
        with pytest.raises(ValueError):
            register_converter("my_qwen", conv)
        register_converter("my_qwen", conv, overwrite=True)
    finally:
        unregister_converter("my_qwen")


def test_qwen3_is_qwen2_plus_qk_norm():
    q2, q3 = get_converter("qwen2"), get_converter("qwen3")
    assert set(m.megatron for m in q3.mappings) - set(m.megatron for m in q2.mappings) == {
        "decoder.layers.*.self_attention.q_layernorm.weight",
        "decoder.layers.*.self_attention.k_layernorm.weight",
    }
    with pytest.raises(ValueError, match="makes 3 tensors"):
        Mapping("a.*.qkv", ("x",), QKV)


def test_tied_output_layer_is_loaded_but_not_emitted():
    conv = get_converter("qwen3")
    tied = model_spec(preset_config("tiny-qwen3-tied"))
    untied = model_spec(preset_config("tiny-qwen3"))
    assert conv.resolve("output_layer.weight", tied).hf_names == ("model.embed_tokens.weight",)
    assert not conv.resolve("output_layer.weight", tied).emit
    assert conv.resolve("output_layer.weight", untied).hf_names == ("lm_head.weight",)


def _megatron_listing(cfg, tp=1, padded_vocab=1024):
    """The (name, local shape, dtype) list a Megatron rank of tiny-qwen3 reports (local spec)."""
    s = model_spec(cfg)
    h, hd = s.hidden_size, s.head_dim
    qkv = (s.num_attention_heads + 2 * s.num_key_value_heads) * hd
    out = [("embedding.word_embeddings.weight", (padded_vocab // tp, h))]
    for i in range(s.num_layers):
        p = f"decoder.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attention.linear_qkv.weight", (qkv // tp, h)),
            (p + "self_attention.q_layernorm.weight", (hd,)),
            (p + "self_attention.k_layernorm.weight", (hd,)),
            (p + "self_attention.linear_proj.weight", (h, s.num_attention_heads * hd // tp)),
            (p + "pre_mlp_layernorm.weight", (h,)),
            (p + "mlp.linear_fc1.weight", (2 * s.intermediate_size // tp, h)),
            (p + "mlp.linear_fc2.weight", (h, s.intermediate_size // tp)),
        ]
    out += [("decoder.final_layernorm.weight", (h,)), ("output_layer.weight", (padded_vocab // tp, h))]
    return [(n, shape, "float32", False) for n, shape in out]


def _table(cfg, listings, tp=1):
    spec = model_spec(cfg)
    ranks = [RankMeta(0, r, 0, 0, tuple(listing)) for r, listing in enumerate(listings)]
    return build_table(ranks, get_converter(spec.model_type), spec, expected_hf_shapes(cfg), tp_size=tp)


def test_table_covers_exactly_the_checkpoint():
    cfg = preset_config("tiny-qwen3")
    table = _table(cfg, [_megatron_listing(cfg, 2)] * 2, tp=2)
    names = [o.name for e in table for o in e.outputs]
    assert sorted(names) == sorted(expected_hf_shapes(cfg))
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    qkv = next(e for e in table if e.name.endswith("0.self_attention.linear_qkv.weight"))
    assert qkv.parts == 2 and qkv.shard_dim == 0 and qkv.full_shape == (256, 64)


def test_table_lists_every_problem_at_once():
    cfg = preset_config("tiny-qwen3")
    listing = _megatron_listing(cfg)
    listing.append(("decoder.layers.0.mlp.mystery.weight", (3,), "float32", False))
    listing.append(("decoder.layers.2.self_attention.rotary.inv_freq", (8,), "float32", False))
    listing = [x for x in listing if x[0] != "decoder.layers.1.self_attention.k_layernorm.weight"]
    listing = [
        (n, (s[0], 70) if n == "decoder.layers.3.mlp.linear_fc2.weight" else s, d, e) for n, s, d, e in listing
    ]
    with pytest.raises(ConversionError) as err:
        _table(cfg, [listing])
    problems = err.value.problems
    assert problems["Megatron tensors no mapping covers"] == [
        "decoder.layers.0.mlp.mystery.weight",
        "decoder.layers.2.self_attention.rotary.inv_freq",
    ]
    assert problems["HF tensors the model does not provide"] == ["model.layers.1.self_attn.k_norm.weight"]
    assert len(problems["shape mismatches"]) == 1
    assert "model.layers.3.mlp.down_proj.weight" in problems["shape mismatches"][0]
    text = str(err.value)
    assert "mystery" in text and "k_norm" in text and "down_proj" in text


def test_config_that_does_not_match_names_every_tensor():
    cfg = preset_config("tiny-qwen3")
    listing = _megatron_listing(cfg)
    other = preset_config("tiny-qwen3")
    other.intermediate_size = 128
    with pytest.raises(ConversionError) as err:
        _table(other, [listing])
    bad = err.value.problems["shape mismatches"]
    assert len(bad) == 3 * 4  # gate, up, down in each of 4 layers
    assert all("config says" in b for b in bad)


def test_te_names_resolve_to_the_same_hf_names():
    conv = get_converter("qwen2")
    spec = model_spec(preset_config("tiny-qwen2"))
    te = conv.resolve("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", spec)
    local = conv.resolve("decoder.layers.3.input_layernorm.weight", spec)
    assert te.hf_names == local.hf_names == ("model.layers.3.input_layernorm.weight",)
    te = conv.resolve("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", spec)
    assert te.hf_names == ("model.layers.3.post_attention_layernorm.weight",)


def test_spec_reads_configs():
    s = model_spec(preset_config("qwen3-8b"))
    assert (s.head_dim, s.q_per_group, s.qkv_bias, s.qk_norm, s.rope_theta) == (128, 4, False, True, 1e6)
    from weightstream.converters.expected import expected_hf_shapes

    shapes = expected_hf_shapes(preset_config("qwen3-4b"))  # Qwen3-4B: 4,022,468,096 parameters, tied
    assert (len(shapes), sum(math.prod(v) for v in shapes.values())) == (398, 4_022_468_096)
    s2 = model_spec(preset_config("tiny-qwen2"))
    assert (s2.head_dim, s2.qkv_bias, s2.qk_norm) == (8, True, False)
    with pytest.raises(UnknownModelError):
        model_spec({"model_type": "phi3", "hidden_size": 8, "num_attention_heads": 2})
