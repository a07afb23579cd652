"""Assertions shared by the distributed tests."""

from __future__ import annotations

import torch

from weightstream.disk import CheckpointReader


def source_keys(src: str) -> list[str]:
    with CheckpointReader(src) as r:
        return sorted(r.keys())


def assert_full_exact(results: list[dict], src: str) -> None:
    """Every rank yielded every HF tensor exactly once, bit-identical to the source checkpoint."""
    keys = source_keys(src)
    for r in results:
        assert r["mismatches"] == [], f"{r['label']} rank {r['rank']}: tensors differ: {r['mismatches']}"
        assert len(r["names"]) == len(set(r["names"])), f"{r['label']}: a tensor was yielded twice"
        assert sorted(r["names"]) == keys, f"{r['label']} rank {r['rank']}: names differ from the checkpoint's"


def assert_per_rank_assembles(results: list[dict], src: str, tp: int) -> None:
    """Put the shards of TP ranks 0..tp-1 together as an engine would; they equal the source tensors."""
    by_tp: dict[int, dict[str, tuple]] = {}
    for r in results:
        shards = {name: (shard, t) for name, shard, t in r["shards"]}
        if r["tp_rank"] in by_tp:  # every rank of the same TP rank yields the same shards
            other = by_tp[r["tp_rank"]]
            assert other.keys() == shards.keys()
            for name in shards:
                assert other[name][0] == shards[name][0]
                assert torch.equal(other[name][1], shards[name][1]), name
        else:
            by_tp[r["tp_rank"]] = shards
    assert sorted(by_tp) == list(range(tp))
    with CheckpointReader(src) as truth:
        keys = set(truth.keys())
        for rank_shards in by_tp.values():
            assert set(rank_shards) == keys
        for name in sorted(keys):
            ref = truth.get(name)
            pieces = [by_tp[r][name] for r in range(tp)]
            if pieces[0][0] is None:
                for shard, t in pieces:
                    assert shard is None and torch.equal(t, ref), name
                continue
            dim = pieces[0][0].dim
            pos = 0
            for shard, t in sorted(pieces, key=lambda p: p[0].start):
                assert shard.dim == dim and shard.full == ref.shape[dim], name
                if shard.length == 0:
                    continue
                assert shard.start == pos, f"{name}: shard starts at {shard.start}, expected {pos}"
                assert t.shape[dim] == shard.length
                pos += shard.length
            assert pos == ref.shape[dim], f"{name}: shards cover {pos} of {ref.shape[dim]}"
            whole = torch.cat([t for shard, t in sorted(pieces, key=lambda p: p[0].start) if shard.length], dim=dim)
            assert torch.equal(whole, ref), name


def assert_logits_close(megatron: torch.Tensor, hf: torch.Tensor, atol: float = 1e-5) -> None:
    assert megatron.shape == hf.shape
    diff = (megatron - hf).abs().max().item()
    assert diff <= atol, f"logits differ by {diff:.3g}"
