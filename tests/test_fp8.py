"""Block FP8: the arithmetic, against the engines' own functions (DeepGEMM's cast as vLLM ships it; SGLang's
power-of-two variant), run on the CPU in their environments (tests/engines/fp8_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.checks import engine_python
from weightstream.converters.fp8 import ceil_to_ue8m0, dequantize_block_fp8, quantize_block_fp8
from weightstream.wire.fp8 import FP8, BlockFP8

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "engines" / "fp8_check.py"


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (5, 7), (128, 128)])
def test_values_scales_and_the_dequantization_bound(shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.03).to(torch.bfloat16)
    q, s = quantize_block_fp8(x)
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and tuple(s.shape) == BlockFP8().scale_shape(shape)
    back = dequantize_block_fp8(q, s, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = x.float()[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = float(block.abs().max())
            assert float(s[i, j]) == pytest.approx(amax / 448.0, rel=1e-6)
            # e4m3: 3 mantissa bits; at the top of the range (448) the spacing is 32, so |x - q*s| <= 16 * s.
            err = (block - back[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).abs().max()
            assert float(err) <= 16 * float(s[i, j]) * (1 + 1e-6)


@pytest.mark.unit
def test_scale_is_the_product_with_the_rounded_inverse_on_any_device():
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    _, s = quantize_block_fp8(x)
    amax = x.float().view(4, 128, 4, 128).abs().amax(dim=(1, 3))
    assert torch.equal(s, amax * (1.0 / 448.0))  # what CUDA computes for amax / 448.0, bit for bit


@pytest.mark.unit
def test_all_zero_block_and_ue8m0_scales():
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    x[128:, 128:] = torch.randn(128, 128).to(torch.bfloat16)
    q, s = quantize_block_fp8(x)
    assert float(s[0, 0]) == pytest.approx(1e-4 / 448.0) and not q[:128, :128].float().any()
    _, p = quantize_block_fp8(x, ue8m0=True)
    mantissa = p.view(torch.int32) & 0x7FFFFF
    assert not mantissa.any() and bool((p >= s).all())  # powers of two, rounded up
    edge = torch.tensor([1.0, 1.0000001, 0.75, 2.0 ** -20], dtype=torch.float32)
    assert ceil_to_ue8m0(edge).tolist() == [1.0, 2.0, 1.0, 2.0 ** -20]


@pytest.mark.unit
def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(torch.zeros(4))
    with pytest.raises(ValueError, match="scale_fmt"):
        BlockFP8(scale_fmt="e8m0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        BlockFP8(block=(0, 128))


def test_matches_deepgemm_cast_as_vllm_ships_it():
    python = engine_python("vllm", "vllm.utils.deep_gemm")
    got = _run(python, "vllm")
    assert got["version"] == "0.32.0"
    for row in got["float"]:
        assert row["fp8_equal_where_scales_equal"] and row["fp8_is_own_last_step"], row
        assert row["other_scales_one_ulp"], row  # CPU true division vs the GPU's product: one ulp at most
        assert row["scales_equal"] >= 1, row
    assert all(r["scales_equal"] and r["fp8_equal"] for r in got["ue8m0"]), got["ue8m0"]


def test_matches_sglang_power_of_two_cast():
    python = engine_python("sglang", "sglang, sglang.srt.weight_sync.tensor_bucket")
    got = _run(python, "sglang")
    assert got["version"] == "0.5.23"
    assert all(r["scales_equal"] and r["fp8_equal"] for r in got["ue8m0"]), got["ue8m0"]


def _run(python: str, which: str) -> dict:
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([python, str(CHECK), which], capture_output=True, text=True, timeout=420, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.unit
def test_rows_of_fused_projection_views_take_two_strides():
    from weightstream.streaming.fp8_cast import row_layout

    fused = torch.zeros(4, 6, 16, 64)  # [groups, q + k + v heads, head dim, hidden]
    assert row_layout(fused[:, :4]) == (6 * 16 * 64, 4 * 16, 64, 1)  # 4 groups of 64 rows, 64 apart
    assert row_layout(fused[:, 4:5]) == (6 * 16 * 64, 16, 64, 1)
    assert row_layout(torch.zeros(40, 64)) == (0, 40, 64, 1)
    assert row_layout(torch.zeros(64, 40).t()) == (0, 40, 1, 40)
    assert row_layout(torch.zeros(1, 64)) == (0, 1, 0, 1)
    assert row_layout(torch.zeros(4, 3, 5, 8)[:, :2, :4]) is None  # three strides
