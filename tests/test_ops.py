"""The pure tensor ops, against layouts built by hand (not by their own inverses)."""

from __future__ import annotations

import pytest
import torch

from weightstream.converters.ops import GATED, IDENTITY, QKV, VOCAB, OpContext
from weightstream.models.spec import ModelSpec

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset


def spec(heads=8, groups=2, head_dim=4, hidden=6, vocab=10) -> ModelSpec:
    return ModelSpec(
        model_type="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=12, num_layers=1,
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim, rms_norm_eps=1e-6,
        rope_theta=1e4, max_position_embeddings=32, tie_word_embeddings=False,
    )


def hand_fused_qkv(q, k, v, groups, head_dim):
    """Megatron's layout written out row block by row block: per group, its q heads, its k, its v."""
    qpg = q.shape[0] // head_dim // groups
    blocks = []
    for g in range(groups):
        for h in range(qpg):
            row = (g * qpg + h) * head_dim
            blocks.append(q[row : row + head_dim])
        blocks.append(k[g * head_dim : (g + 1) * head_dim])
        blocks.append(v[g * head_dim : (g + 1) * head_dim])
    return torch.cat(blocks)


@pytest.mark.parametrize("heads,groups", [(8, 2), (8, 8), (4, 1), (6, 3)])
@pytest.mark.parametrize("with_hidden", [True, False])
def test_qkv_split_matches_hand_layout(heads, groups, with_hidden):
    s = spec(heads=heads, groups=groups)
    rest = (s.hidden_size,) if with_hidden else ()
    q = torch.randn(heads * s.head_dim, *rest)
    k = torch.randn(groups * s.head_dim, *rest)
    v = torch.randn(groups * s.head_dim, *rest)
    fused = hand_fused_qkv(q, k, v, groups, s.head_dim)
    out = QKV.to_hf(fused, OpContext(s))
    assert all(torch.equal(a, b) for a, b in zip(out, (q, k, v), strict=True))
    assert torch.equal(QKV.to_megatron([q, k, v], OpContext(s), fused.shape), fused)


def test_qkv_shard_is_what_an_engine_rank_holds():
    """TP rank r holds whole groups; splitting its shard gives the engine's rows of q, k and v."""
    s = spec(heads=8, groups=4)
    q, k, v = (torch.randn(n * s.head_dim, s.hidden_size) for n in (8, 4, 4))
    fused = hand_fused_qkv(q, k, v, 4, s.head_dim)
    tp = 2
    for r, shard in enumerate(fused.chunk(tp)):
        sq, sk, sv = QKV.to_hf(shard, OpContext(s, parts=1, shard_rank=r))
        assert torch.equal(sq, q.chunk(tp)[r]) and torch.equal(sk, k.chunk(tp)[r]) and torch.equal(sv, v.chunk(tp)[r])


def test_qkv_equal_thirds_would_be_wrong():
    # Guard for the test itself: with heads != groups, naive thirds differ from the real split.
    s = spec(heads=8, groups=2)
    fused = torch.arange(12 * s.head_dim, dtype=torch.float32).unsqueeze(1)
    q, _, _ = QKV.to_hf(fused, OpContext(s))
    assert q.shape[0] == 8 * s.head_dim and not torch.equal(q, fused[: 8 * s.head_dim])


def test_qkv_rejects_rows_not_made_of_groups():
    s = spec(heads=8, groups=2)
    with pytest.raises(ValueError, match="not a multiple"):
        QKV.to_hf(torch.zeros(13, 6), OpContext(s))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_split_across_tp_shards(tp):
    s = spec()
    gate, up = torch.randn(8, 6), torch.randn(8, 6)
    # Each TP rank's shard is [gate_r; up_r]; the gathered tensor concatenates the shards.
    shards = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
    gathered = torch.cat(shards)
    g2, u2 = GATED.to_hf(gathered, OpContext(s, parts=tp))
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    assert torch.equal(GATED.to_megatron([gate, up], OpContext(s, parts=tp), gathered.shape), gathered)
    for r, shard in enumerate(shards):
        gr, ur = GATED.to_hf(shard, OpContext(s, parts=1, shard_rank=r))
        assert torch.equal(gr, gate.chunk(tp)[r]) and torch.equal(ur, up.chunk(tp)[r])
    if tp > 1:  # chunking the whole in two is the classic bug
        assert not torch.equal(gathered.chunk(2)[0], gate)


def test_vocab_trim_full_and_shards():
    s = spec(vocab=10)
    padded = torch.randn(16, 6)
    (full,) = VOCAB.to_hf(padded, OpContext(s))
    assert torch.equal(full, padded[:10])
    kept = []
    for r, shard in enumerate(padded.chunk(4)):  # 4 rows each: rank 2 keeps 2, rank 3 keeps none
        (t,) = VOCAB.to_hf(shard, OpContext(s, parts=1, shard_rank=r))
        kept.append(t.shape[0])
        assert torch.equal(t, padded[r * 4 : r * 4 + t.shape[0]])
    assert kept == [4, 4, 2, 0]
    back = VOCAB.to_megatron([full], OpContext(s), padded.shape)
    assert torch.equal(back[:10], full) and torch.count_nonzero(back[10:]) == 0


def test_ops_run_on_meta_tensors():
    s = spec(heads=8, groups=2)
    meta = torch.empty(12 * s.head_dim, s.hidden_size, device="meta")
    shapes = [tuple(t.shape) for t in QKV.to_hf(meta, OpContext(s))]
    assert shapes == [(32, 6), (8, 6), (8, 6)]
    assert IDENTITY.to_hf(meta, OpContext(s))[0] is meta


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_writing_into_bucket_views_equals_to_hf(parts):
    """The one-copy path (``pieces``, used when packing buckets) gives exactly ``to_hf``'s tensors."""
    from weightstream.converters.ops import convert_into

    s = spec(heads=8, groups=4)
    fused = torch.randn(4 * (2 + 2) * s.head_dim, s.hidden_size)
    fc1 = torch.randn(2 * 8 * parts, s.hidden_size)
    for op, t, ctx in ((QKV, fused, OpContext(s)), (GATED, fc1, OpContext(s, parts=parts)),
                       (VOCAB, torch.randn(16, 6), OpContext(s)), (IDENTITY, fc1, OpContext(s))):
        want = op.to_hf(t, ctx)
        outs = [torch.empty_like(w) for w in want]
        convert_into(op, t, ctx, outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
    with pytest.raises(ValueError):
        convert_into(VOCAB, torch.randn(16, 6), OpContext(s), [torch.empty(11, 6)])


def test_per_mtp_layer_copies_and_checks_them_back():
    """DeepSeek-V3's MTP layers keep their own copy of the embedding: the trimmed rows once, then once per MTP
    layer; back to Megatron the padded rows from the first, and copies that differ are refused."""
    from dataclasses import replace

    from weightstream.converters.ops import PerMTPLayer

    op = PerMTPLayer(VOCAB)
    ctx = OpContext(replace(spec(vocab=10), mtp_layers=2))
    padded = torch.randn(16, 6)
    outs = op.to_hf(padded, ctx)
    assert len(outs) == 3 and all(torch.equal(o, padded[:10]) for o in outs)
    assert len(op.to_hf(padded, OpContext(spec(vocab=10)))) == 1  # no MTP layer: the tensor alone
    back = op.to_megatron([padded[:10].clone() for _ in range(3)], ctx, padded.shape)
    assert torch.equal(back[:10], padded[:10]) and not back[10:].any()
    spoiled = padded[:10].clone()
    spoiled[3, 1] += 1
    with pytest.raises(ValueError, match=r"MTP layers \[1\] differ"):
        op.to_megatron([padded[:10], padded[:10], spoiled], ctx, padded.shape)
