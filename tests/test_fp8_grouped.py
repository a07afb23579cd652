"""Block FP8 in groups: same-shaped tensors (a layer's experts of one projection) quantized as one
``[group, rows, cols]`` tensor give each tensor's values and scales bit for bit as it quantized alone does, and a
bucket's casts (:class:`~weightstream.streaming.quantize.QuantizeBatch`, the path of every device without the
Triton kernel) go through those groups."""

from __future__ import annotations

import pytest
import torch

from weightstream.converters.fp8 import quantize_block_fp8, quantize_block_fp8_grouped, quantize_weight
from weightstream.streaming import quantize
from weightstream.streaming.fp8_cast import CastJob
from weightstream.streaming.quantize import QuantizeBatch
from weightstream.wire.fp8 import FP8, BlockFP8

SHAPES = [(256, 384), (300, 130), (5, 7), (128, 128), (129, 257), (1, 1000), (768, 200)]


def _group(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Seven tensors of ``shape``: ordinary values, all zeros, tiny (subnormal in e4m3 after scaling), huge,
    one block of zeros beside ordinary values, a single large outlier, and negative values only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, *shape, generator=g) * 0.03
    x[1] = 0
    x[2] *= 1e-30
    x[3] *= 1e30
    x[4, : shape[0] // 2] = 0
    x[5, shape[0] - 1, shape[1] - 1] = 3e4
    x[6] = -x[6].abs()
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.unit
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_a_group_quantizes_each_tensor_as_it_alone_does(shape, dtype, ue8m0):
    x = _group(shape, dtype, seed=sum(shape))
    values, scales = quantize_block_fp8_grouped(x, ue8m0=ue8m0)
    assert values.dtype == FP8 and values.shape == x.shape and values.is_contiguous()
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (7, *BlockFP8().scale_shape(shape))
    for k in range(7):
        q, s = quantize_block_fp8(x[k], ue8m0=ue8m0)
        assert torch.equal(_bits(values[k]), _bits(q)), (shape, dtype, k)
        assert torch.equal(_bits(scales[k]), _bits(s)), (shape, dtype, k)


@pytest.mark.unit
@pytest.mark.parametrize("block", [(16, 16), (128, 64), (32, 48)])
def test_other_blocks_and_a_group_of_one(block):
    x = _group((100, 70), torch.bfloat16, seed=3)
    values, scales = quantize_block_fp8_grouped(x, block)
    one_v, one_s = quantize_block_fp8_grouped(x[2:3], block)
    for k in range(7):
        q, s = quantize_block_fp8(x[k], block)
        assert torch.equal(_bits(values[k]), _bits(q)) and torch.equal(_bits(scales[k]), _bits(s))
    q, s = quantize_block_fp8(x[2], block)
    assert torch.equal(_bits(one_v[0]), _bits(q)) and torch.equal(_bits(one_s[0]), _bits(s))


@pytest.mark.unit
def test_a_group_must_be_three_dimensional():
    with pytest.raises(ValueError, match=r"grouped block FP8 quantizes \[group, rows, cols\], got shape \(4, 4\)"):
        quantize_block_fp8_grouped(torch.zeros(4, 4))


def _jobs(fp8: BlockFP8) -> list[CastJob]:
    """A bucket's casts as a MoE layer makes them: gate and up the two halves of each expert's fused fc1 (views,
    rows one stride apart), down each expert's fc2, a ragged attention weight in float32, and a view that cuts
    heads out of a fused projection (rows in two strides)."""
    g = torch.Generator().manual_seed(5)
    fc1 = (torch.randn(4, 2 * 48, 40, generator=g) * 0.02).to(torch.bfloat16)
    fc2 = (torch.randn(4, 40, 48, generator=g) * 0.02).to(torch.bfloat16)
    qkv = torch.randn(2, 3, 8, 40, generator=g).to(torch.bfloat16)  # [groups, (q, k, v), head dim, hidden]
    sources = ([fc1[e, :48] for e in range(4)] + [fc1[e, 48:] for e in range(4)] + [fc2[e] for e in range(4)]
               + [torch.randn(33, 70, generator=g), qkv[:, 0]])
    jobs = []
    for s in sources:
        shape = (s.numel() // s.shape[-1], s.shape[-1])
        jobs.append(CastJob(s, torch.empty(shape, dtype=FP8), torch.empty(fp8.scale_shape(shape))))
    return jobs


@pytest.mark.unit
@pytest.mark.parametrize("group_bytes", [256 << 20, 8000])
def test_a_buckets_casts_go_by_groups_bit_for_bit(monkeypatch, group_bytes):
    """Every job's values and scales those of the tensor quantized alone, whether a group is cast at once or
    (a smaller :data:`~weightstream.streaming.quantize.GROUP_BYTES`) in runs."""
    monkeypatch.setitem(quantize.GROUP_BYTES, "cpu", group_bytes)
    fp8 = BlockFP8((16, 16))
    jobs = _jobs(fp8)
    batch = QuantizeBatch(fp8)
    for job in jobs:
        batch.add(job)
    batch.run()
    for job in jobs:
        q, s = quantize_weight(fp8, job.source.reshape(job.values.shape))
        assert torch.equal(_bits(job.values), _bits(q)) and torch.equal(_bits(job.scales.view(s.shape)), _bits(s))


@pytest.mark.unit
def test_the_kernels_table_rows_made_once_per_form_are_each_jobs_own():
    """The Triton kernel's table (:class:`~weightstream.streaming.fp8_cast.BlockCast`) is made per form of job
    (dtype, shapes and strides: a layer's experts of one projection), its checks and row layout once per form:
    each job's row and fast-form choice are still those of the job alone (its own addresses,
    :func:`~weightstream.streaming.fp8_cast.takes_aligned`, :func:`~weightstream.streaming.fp8_cast.row_layout`).
    Made on the CPU (the tables are plain integers); the kernel itself runs on GPUs (tools/gpu_fp8_kernel.py)."""
    from weightstream.streaming.fp8_cast import _form_rows, _forms, row_layout, takes_aligned

    fp8 = BlockFP8((16, 16))
    g = torch.Generator().manual_seed(9)
    fc1 = torch.randn(3, 64, 32, generator=g).to(torch.bfloat16)
    flat = torch.randn(2 * 32 * 32 + 1, generator=g).to(torch.bfloat16)
    sources = ([fc1[e, :32] for e in range(3)] + [fc1[e, 32:] for e in range(3)]  # experts' gate and up
               + [flat[1:1 + 32 * 32].view(32, 32), flat[:32 * 32].view(32, 32)]  # one off 16-byte alignment
               + [torch.randn(48, 40, generator=g).t(), torch.randn(33, 70, generator=g)]  # strided; ragged fp32
               + [torch.randn(2, 3, 16, 32, generator=g)[:, 0]])  # rows in two strides
    jobs = []
    for s in sources:
        shape = (s.numel() // s.shape[-1], s.shape[-1])
        jobs.append(CastJob(s, torch.empty(shape, dtype=FP8), torch.empty(fp8.scale_shape(shape))))
    made = {}
    for form in _forms(jobs):
        for job, (aligned, row, blocks) in zip(form, _form_rows(form, fp8), strict=True):
            made[id(job)] = (aligned, row, blocks)
    assert len(made) == len(jobs) and len(_forms(jobs)) < len(jobs)
    kinds = set()
    for job in jobs:
        aligned = takes_aligned(job.source, tuple(job.values.shape), job.values.data_ptr(), fp8)
        outer, inner_rows, inner, step = row_layout(job.source)
        (n, m), grid, u = job.values.shape, fp8.scale_shape(tuple(job.values.shape)), 16 if aligned else 1
        row = [job.source.data_ptr() // u, outer // u, inner // u, step, inner_rows, n, m // u,
               job.values.data_ptr() // u, job.scales.data_ptr(), grid[1]]
        assert made[id(job)] == (aligned, row, grid[0] * grid[1])
        kinds.add(aligned)
    assert kinds == {True, False}
