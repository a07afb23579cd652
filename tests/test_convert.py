"""Megatron-Core checkpoints on disk -> HF: real Megatron jobs (gloo) save with Megatron's own
``dist_checkpointing.save`` (torch_dist) and in the legacy per-rank layout; ``convert_checkpoint`` /
``weightstream convert`` in one process must give the HF checkpoint the job was built from, bit for bit,
whose logits equal the Megatron model's; and bad input gets one clear error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import INPUT_IDS, assert_logits_close
from weightstream.common.hf_files import CheckpointReader
from weightstream.convert import convert_checkpoint
from weightstream.errors import ConversionError
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.sources.megatron_checkpoint import CheckpointFormatError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dense model saved by a TP 2 x PP 2 job, and an MoE model by a PP 2 x VPP 2 x EP 2 job (4 ranks),
    each in both formats, with the Megatron models' logits."""
    from tests.helpers.megatron_saves import run_saves
    from tests.helpers.workers import Case

    root = tmp_path_factory.mktemp("megatron")
    dense = save_random_checkpoint(preset_config("tiny-qwen3"), root / "hf-dense", seed=81)
    moe = save_random_checkpoint(preset_config("tiny-qwen3-moe"), root / "hf-moe", seed=82)
    cases = [(Case(dense, Layout(2, 2)), str(root / "dense")),
             (Case(moe, Layout(1, 2, vpp=2, ep=2)), str(root / "moe"))]
    results = launch(4, run_saves, cases)
    (dense_out, moe_out) = results[-1]  # the last stage holds the logits
    return {"dense": (dense, root / "dense", dense_out["logits"]), "moe": (moe, root / "moe", moe_out["logits"])}


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_convert_is_bit_identical_with_equal_logits(saved, model, fmt, tmp_path):
    src, root, megatron_logits = saved[model]
    out = tmp_path / "hf"
    done = []
    report = convert_checkpoint(root / fmt, src, out, bucket_bytes=40_000, verify=src,
                                progress=lambda d, n: done.append((d, n)))
    assert report.format == fmt and report.iteration == 7
    assert report.verify.ok, report.verify.render(src, str(out))
    assert report.verify.compared == len(CheckpointReader(src).keys())
    assert done[-1][0] == done[-1][1] > 1
    assert_logits_close(hf_logits(str(out), INPUT_IDS), megatron_logits)
    assert report.peak_rss > 0 and report.largest_layer[0].startswith("model.layers.")


def test_convert_cli_with_dtype(saved, tmp_path):
    src, root, _ = saved["dense"]
    out = tmp_path / "bf16"
    run = subprocess.run([sys.executable, "-m", "weightstream.cli", "convert", str(root / "legacy" / "iter_0000007"),
                          "--hf", src, "--out", str(out), "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "legacy checkpoint (iteration 7)" in run.stdout and "peak RSS" in run.stdout
    with CheckpointReader(src) as want, CheckpointReader(out) as got:
        assert set(got.keys()) == set(want.keys())
        for name in want.keys():
            assert got.get(name).dtype == torch.bfloat16
            assert torch.equal(got.get(name), want.get(name).to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # --verify against a checkpoint that differs: exit 1, the differing tensors listed.
    run = subprocess.run([sys.executable, "-m", "weightstream.cli", "convert", str(root / "torch_dist"),
                          "--hf", src, "--out", str(tmp_path / "again"), "--verify", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "dtypes differ" in run.stdout


def test_convert_in_two_processes(saved, tmp_path):
    """``procs=2``: each process reads only the buckets its own safetensors files need; one index."""
    src, root, _ = saved["moe"]
    report = convert_checkpoint(root / "torch_dist", src, tmp_path / "out", procs=2, bucket_bytes=40_000,
                                shard_bytes=200_000, verify=src)
    assert report.verify.ok, report.verify.render(src, str(tmp_path / "out"))
    assert report.files >= 4


def test_bad_input_gets_one_clear_error(saved, tmp_path):
    src, root, _ = saved["dense"]
    # Not a checkpoint.
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointFormatError, match="not a Megatron checkpoint"):
        convert_checkpoint(tmp_path / "empty", src, tmp_path / "o1")
    # An iteration that does not exist: the ones that do are listed.
    with pytest.raises(CheckpointFormatError, match=r"iteration 9 is not in .*; it holds iterations: 7"):
        convert_checkpoint(root / "legacy", src, tmp_path / "o2", iteration=9)
    # A missing shard file, named (both formats).
    broken = tmp_path / "legacy"
    shutil.copytree(root / "legacy", broken)
    shutil.rmtree(broken / "iter_0000007" / "mp_rank_01_001")
    with pytest.raises(CheckpointFormatError, match=r"missing 1 rank file\(s\): mp_rank_01_001"):
        convert_checkpoint(broken, src, tmp_path / "o3")
    broken = tmp_path / "dist"
    shutil.copytree(root / "torch_dist", broken)
    os.remove(broken / "iter_0000007" / "__1_0.distcp")
    with pytest.raises(CheckpointFormatError, match=r"missing 1 shard file\(s\): __1_0.distcp"):
        convert_checkpoint(broken, src, tmp_path / "o4")
    # An unknown format version.
    meta = broken / "iter_0000007" / "metadata.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "sharded_backend": "zarr"}))
    with pytest.raises(CheckpointFormatError, match="unknown distributed checkpoint format.*'zarr'"):
        convert_checkpoint(broken, src, tmp_path / "o5")
    # A config that does not match the checkpoint's shapes: every mismatch listed, nothing written.
    cfg = json.loads((open(os.path.join(src, "config.json"))).read())
    cfg.update(intermediate_size=128, num_hidden_layers=3)
    cfg.pop("layer_types", None)
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(root / "torch_dist", cfg, tmp_path / "o6")
    text = str(err.value)
    assert "model.layers.3.mlp.gate_proj.weight" in text  # a layer the config does not have
    for layer in range(3):
        assert f"model.layers.{layer}.mlp.down_proj.weight: config says (64, 128)" in text
    assert not (tmp_path / "o6").exists() or not any((tmp_path / "o6").glob("*.safetensors"))


@pytest.mark.parametrize("model,fmt,procs", [("dense", "torch_dist", 1), ("moe", "legacy", 2)])
def test_convert_to_block_fp8(saved, model, fmt, procs, tmp_path):
    """A Megatron checkpoint on disk converted to block FP8: every tensor equals the source's, those the family
    declares FP8 quantized (values and scales bit for bit), with the matching quantization_config."""
    from tests.helpers.fp8_truth import same_bits, truth_of
    from weightstream.wire.fp8 import BlockFP8

    fp8 = BlockFP8(block=(16, 16))
    src, root, _ = saved[model]
    out = tmp_path / "fp8"
    convert_checkpoint(root / fmt, src, out, bucket_bytes=40_000, quantize=fp8, procs=procs)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [16, 16]
    with truth_of(src, fp8) as want, CheckpointReader(out) as got:
        assert sorted(got.keys()) == want.keys()
        for name in want.keys():
            assert same_bits(got.get(name), want.get(name)), name
