"""Assertions shared by the distributed tests."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from tests.helpers.fp8_truth import same_bits, truth_of
from weightstream.common.hf_files import CheckpointReader
from weightstream.wire.fp8 import BlockFP8

# The prompts every logits check feeds (token ids below every tiny vocabulary).
INPUT_IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433], [999, 0, 1, 2, 500, 501, 77, 88, 99, 111]]


def by_label(results_per_rank: list[list[dict]]) -> dict[str, list[dict]]:
    """Results of a launch that ran several labelled cases, grouped by label (all ranks)."""
    out: dict[str, list[dict]] = {}
    for rank_results in results_per_rank:
        for r in rank_results:
            out.setdefault(r["label"], []).append(r)
    return out


def source_keys(src: str, fp8: BlockFP8 | None = None) -> list[str]:
    with truth_of(src, fp8) as r:
        return sorted(r.keys())


def assert_full_exact(results: list[dict], src: str, fp8: BlockFP8 | None = None) -> None:
    """Every rank yielded every HF tensor exactly once, bit-identical to the source checkpoint (quantized to
    block FP8 where ``fp8``)."""
    keys = source_keys(src, fp8)
    for r in results:
        assert r["mismatches"] == [], f"{r['label']} rank {r['rank']}: tensors differ: {r['mismatches']}"
        assert len(r["names"]) == len(set(r["names"])), f"{r['label']}: a tensor was yielded twice"
        assert sorted(r["names"]) == keys, f"{r['label']} rank {r['rank']}: names differ from the checkpoint's"


def assert_per_rank_assembles(results: list[dict], src: str, tp: int, fp8: BlockFP8 | None = None) -> None:
    """Put the shards of TP ranks 0..tp-1 together as an engine would; they equal the source tensors (each
    shard quantized on its own equals the slice of the whole tensor quantized, where ``fp8``)."""
    by_tp: dict[int, dict[str, tuple]] = {}
    for r in results:
        shards = {name: (shard, t) for name, shard, t in r["shards"]}
        if r["tp_rank"] in by_tp:  # every rank of the same TP rank yields the same shards
            other = by_tp[r["tp_rank"]]
            assert other.keys() == shards.keys()
            for name in shards:
                assert other[name][0] == shards[name][0]
                assert same_bits(other[name][1], shards[name][1]), name
        else:
            by_tp[r["tp_rank"]] = shards
    assert sorted(by_tp) == list(range(tp))
    with truth_of(src, fp8) as truth:
        keys = set(truth.keys())
        for rank_shards in by_tp.values():
            assert set(rank_shards) == keys
        for name in sorted(keys):
            _assert_assembles(name, [by_tp[r][name] for r in range(tp)], truth.get(name))


def _assert_assembles(name: str, pieces: list[tuple], ref: torch.Tensor) -> None:
    """``pieces`` ((shard, tensor) of every engine rank) put together give ``ref``, bit for bit."""
    if pieces[0][0] is None:
        for shard, t in pieces:
            assert shard is None and same_bits(t, ref), name
        return
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
    assert same_bits(whole, ref), name


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")  # block_sparse_moe: Mixtral


def assert_per_rank_experts(results: list[dict], src: str, num_experts: int, ep: int, tp: int, etp: int) -> None:
    """per_rank mode with experts: each rank yields exactly the global experts its EP rank owns (every
    MoE layer), cut by its expert-TP rank, plus every non-expert tensor cut by its TP rank; and what
    the ranks yield, put together as an engine of the same EP/TP/expert-TP would, is the source."""
    per_rank = num_experts // ep
    pieces: dict[str, dict[tuple, tuple]] = {}
    with CheckpointReader(src) as truth:
        keys = set(truth.keys())
        moe_layers = {int(m.group(1)) for k in keys if (m := _EXPERT.match(k))}
        non_expert = {k for k in keys if not _EXPERT.match(k)}
        for r in results:
            names = [n for n, _, _ in r["shards"]]
            assert len(names) == len(set(names)), f"{r['label']} rank {r['rank']}: a tensor was yielded twice"
            own = set(range(r["ep_rank"] * per_rank, (r["ep_rank"] + 1) * per_rank))
            for layer in moe_layers:
                held = {int(m.group(2)) for n in names if (m := _EXPERT.match(n)) and int(m.group(1)) == layer}
                assert held == own, (f"{r['label']} rank {r['rank']} layer {layer}: experts {sorted(held)}, "
                                     f"owns {sorted(own)}")
            assert {n for n in names if not _EXPERT.match(n)} == non_expert
            for name, shard, t in r["shards"]:
                # The engine rank that holds this piece: (EP rank, expert-TP rank) for experts, TP rank otherwise.
                slot = (r["ep_rank"], r["etp_rank"]) if _EXPERT.match(name) else (r["tp_rank"],)
                held = pieces.setdefault(name, {})
                if slot in held:  # replicas (DP, other EP ranks) must agree exactly
                    assert held[slot][0] == shard and torch.equal(held[slot][1], t), name
                else:
                    held[slot] = (shard, t)
        assert set(pieces) == keys
        for name in sorted(keys):
            want = etp if _EXPERT.match(name) else tp
            assert len(pieces[name]) == want, f"{name}: pieces from {sorted(pieces[name])}"
            _assert_assembles(name, list(pieces[name].values()), truth.get(name))


def expert_checksums(model_dir) -> dict[str, str]:
    """The checksum of each routed expert's tensor in the checkpoint ``model_dir`` (float8 values and scales included,
    where it is block FP8): the bytes an engine rank that holds the expert must hold."""
    from weightstream.wire.handles import checksum

    with CheckpointReader(model_dir) as reader:
        return {n: checksum(reader.get(n).contiguous().reshape(-1).view(torch.uint8))
                for n in reader.keys() if ".mlp.experts." in n}


def _expert_index(name: str) -> int:
    return int(name.split(".mlp.experts.")[1].split(".")[0])


def assert_experts_held_by_owners(held: list[dict[str, str]], want: dict[str, str], ep: int) -> None:
    """``held``: per engine rank, the checksums of what it holds of the experts (``weight_checksums``). Rank r of EP
    ``ep`` holds exactly experts [r·E/ep, (r+1)·E/ep) of every layer, each bit for bit ``want``."""
    experts = 1 + max(_expert_index(n) for n in want)
    assert len(held) == ep
    for rank, got in enumerate(held):
        mine = {n for n in want if _expert_index(n) * ep // experts == rank}
        assert set(got) == mine, rank
        assert got == {n: want[n] for n in mine}, rank


def assert_logits_close(megatron: torch.Tensor, hf: torch.Tensor, atol: float = 1e-5) -> None:
    assert megatron.shape == hf.shape
    diff = (megatron - hf).abs().max().item()
    assert diff <= atol, f"logits differ by {diff:.3g}"


def engine_python(engine: str, probe: str) -> str:
    """The python named by ``WEIGHTSTREAM_<ENGINE>_PYTHON`` that can ``import`` ``probe``; the test is skipped
    without one, and failed instead when ``WEIGHTSTREAM_REQUIRE_<ENGINE>=1``."""
    python = _named_python(engine)
    _skip_unless_it_imports(engine, python, probe)
    return python


def _named_python(engine: str) -> str:
    """``WEIGHTSTREAM_<ENGINE>_PYTHON``; the test skipped (or failed, as :func:`engine_python`) where it is unset."""
    var = f"WEIGHTSTREAM_{engine.upper()}_PYTHON"
    python = os.environ.get(var)
    if not python:
        _skip_or_fail(engine, f"{var} is not set")
    return str(python)


def _skip_unless_it_imports(engine: str, python: str, probe: str) -> None:
    proc = subprocess.run([python, "-c", f"import {probe}"], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        _skip_or_fail(engine, f"{python} cannot import {engine}: {proc.stderr.strip().splitlines()[-1:]}")


def _skip_or_fail(engine: str, why: str) -> None:
    require = f"WEIGHTSTREAM_REQUIRE_{engine.upper()}"
    if os.environ.get(require) == "1":
        pytest.fail(f"{require}=1 but {why}")
    pytest.skip(why)


def run_engine_check(python: str, script, cwd) -> dict:
    """Run an engine check script with ``python`` (without our PYTHONPATH); its last stdout line, as JSON."""
    import json

    proc = _run_check(python, script, cwd)
    assert proc.returncode == 0, f"{script} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engine_check(engine: str, probe: str, script, cwd) -> dict:
    """:func:`run_engine_check` with :func:`engine_python`'s python, its import of ``probe`` tried only where the
    script failed (the engine's import is most of a check's time): skipped, or failed under
    ``WEIGHTSTREAM_REQUIRE_<ENGINE>=1``, where that python cannot import the engine, as :func:`engine_python`;
    otherwise a failure of the script is the test's failure."""
    import json

    python = _named_python(engine)
    proc = _run_check(python, script, cwd)
    if proc.returncode:
        _skip_unless_it_imports(engine, python, probe)
    assert proc.returncode == 0, f"{script} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_check(python: str, script, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([python, str(script)], capture_output=True, text=True, timeout=420, cwd=cwd, env=env)
