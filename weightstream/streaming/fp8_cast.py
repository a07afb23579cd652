"""Block FP8 for many tensors in one kernel launch: each block read once, straight from where it lives.

:class:`BlockCast` quantizes a list of 2-D tensors (any strides: the views of live parameters a converter
reads) into their float8 values and float32 scales (contiguous: places in a bucket, or an engine's own
tensors) with one launch of a Triton kernel per source dtype, one program per block. A program reads its
block 64 rows at a time for the amax, then again (from L2) for the values, and stores values and scale: one read
of the source from memory and one write of the values, where the same arithmetic in whole-tensor operations makes
about seven passes over memory. (Two warps and 64 rows at a time keep the most blocks in flight: on an H200 the
linear weights of Qwen3-8B quantize in 0.94× the time of a device copy of their bf16 bytes, those of
Qwen3-30B-A3B in 0.85×; a whole block at once with four warps took 1.26× and 1.22×, tools/gpu_fp8_kernel.py.)

The arithmetic is :mod:`weightstream.converters.fp8`'s, bit for bit: the amax in float32 clamped to ``1e-4``,
``scale = amax × fp32(1/448)`` (UE8M0: rounded up to a power of two from its bits), the values
``x × (1 / scale)`` with the reciprocal correctly rounded (``div_rn``, as the torch reciprocal computes it; a
plain ``/`` in Triton is an approximate division) and the cast to e4m3 rounding to nearest even. The tables of
addresses are made once per call list, so a :class:`BlockCast` is kept only where the addresses stay (a kept
plan's views into kept buffers or targets). Used on CUDA devices where Triton is present; everything else
quantizes with whole-tensor operations (:class:`weightstream.streaming.quantize.QuantizeBatch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from weightstream.common.triton_kernel import LazyKernel
from weightstream.converters.fp8 import FP8_MAX, MIN_AMAX
from weightstream.wire.fp8 import FP8, BlockFP8

__all__ = ["CastJob", "available", "BlockCast", "takes_aligned", "warm_kernel", "row_layout"]


@dataclass(frozen=True)
class CastJob:
    """One tensor to quantize: ``source`` (any float dtype; its last dimension the columns, the others the rows,
    in any strides :func:`row_layout` reads) into ``values`` (2-D, contiguous, float8_e4m3fn) and ``scales``
    (contiguous float32, one per block)."""

    source: Tensor
    values: Tensor
    scales: Tensor


def _build(triton: Any, tl: Any) -> Any:
    """The kernel: per block (a program's), the amax, the scale and the values."""

    @triton.jit
    def cast_blocks(jobs, owners, firsts, SRC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                    PR: tl.constexpr, PC: tl.constexpr, UE8M0: tl.constexpr, MAX: tl.constexpr,
                    FLOOR: tl.constexpr, ALIGNED: tl.constexpr, STEP: tl.constexpr):
        pid = tl.program_id(0)
        job = tl.load(owners + pid).to(tl.int64)
        row = jobs + job * 10
        local = pid - tl.load(firsts + job)
        grid_cols = tl.load(row + 9)
        bi = local // grid_cols
        bj = local % grid_cols
        ci = tl.arange(0, PC)[None, :]
        c = bj * BC + ci
        inner = tl.load(row + 4)  # rows of the source's inner row dimension (see row_layout)
        if ALIGNED:  # whole blocks within one inner run of rows, rows contiguous, addresses and strides in 16s
            # (stored divided by 16); STEP rows at a time: the amax over the block, then its values (from L2)
            src = (tl.load(row) * 16).to(tl.pointer_type(SRC))
            first = bi * BR
            pitch = tl.load(row + 2) * 16
            base = src + (first // inner) * (tl.load(row + 1) * 16) + (first % inner) * pitch + c
            cols = tl.load(row + 6) * 16
            dst = (tl.load(row + 7) * 16).to(tl.pointer_type(tl.float8e4nv)) + first * cols + c
            rs = tl.arange(0, STEP)[:, None]
            amax = tl.max(tl.max(tl.abs(tl.load(base + rs * pitch)), axis=1), axis=0).to(tl.float32)
            for k in range(STEP, BR, STEP):
                part = tl.max(tl.max(tl.abs(tl.load(base + (k + rs) * pitch)), axis=1), axis=0)
                amax = tl.maximum(amax, part.to(tl.float32))
        else:
            ri = tl.arange(0, PR)[:, None]
            r = bi * BR + ri
            src = tl.load(row).to(tl.pointer_type(SRC))
            at = (r // inner) * tl.load(row + 1) + (r % inner) * tl.load(row + 2)
            cols = tl.load(row + 6)
            dst = tl.load(row + 7).to(tl.pointer_type(tl.float8e4nv))
            mask = (ri < BR) & (ci < BC) & (r < tl.load(row + 5)) & (c < cols)
            x = tl.load(src + at + c * tl.load(row + 3), mask=mask, other=0.0).to(tl.float32)
            amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.maximum(amax, FLOOR) * (1.0 / MAX)
        if UE8M0:
            bits = scale.to(tl.int32, bitcast=True)
            exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            exponent = tl.minimum(tl.maximum(exponent, 1), 254)
            scale = (exponent << 23).to(tl.float32, bitcast=True)
        inverse = tl.math.div_rn(1.0, scale)
        if ALIGNED:
            for k in range(0, BR, STEP):
                x = tl.load(base + (k + rs) * pitch).to(tl.float32)
                tl.store(dst + (k + rs) * cols, (x * inverse).to(tl.float8e4nv))
        else:
            tl.store(dst + r * cols + c, (x * inverse).to(tl.float8e4nv), mask=mask)
        tl.store(tl.load(row + 8).to(tl.pointer_type(tl.float32)) + local, scale)

    return cast_blocks


# The kernel, compiled on first launch (None without Triton); WEIGHTSTREAM_FP8_KERNEL=0 keeps whole-tensor operations.
_compile = LazyKernel(_build, "WEIGHTSTREAM_FP8_KERNEL")


def available(device: torch.device) -> bool:
    """On ``device``, with Triton present, unless ``WEIGHTSTREAM_FP8_KERNEL=0``."""
    return _compile.available(device)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class BlockCast:
    """Every job quantized, one launch per source dtype on the current stream. The tensors are held, so the
    addresses in the tables stay theirs. The tables are made per form of job (:func:`_forms`: a layer's experts of
    one projection share one), each job adding its addresses: one Qwen3-30B-A3B layer's 384 expert tensors took
    6.3 ms to make and launch per call on an H100, 3.9 ms so (the launch alone 0.9 ms)."""

    def __init__(self, jobs: Sequence[CastJob], fp8: BlockFP8, num_warps: int = 2, rows_per_step: int = 64):
        import triton.language as tl

        self.held = list(jobs)
        self.fp8 = fp8
        self.kernel = _compile()
        self.num_warps = num_warps
        self.step = min(rows_per_step, fp8.block[0])  # rows of a whole block a program reads at once
        launches: dict[tuple[torch.dtype, bool], tuple[list[list[int]], list[int]]] = {}
        for form in _forms(jobs):
            for aligned, row, blocks in _form_rows(form, fp8):
                rows, counts = launches.setdefault((form[0].source.dtype, aligned), ([], []))
                rows.append(row)
                counts.append(blocks)
        names = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
        device = jobs[0].source.device if jobs else torch.device("cpu")
        self.launches = [(names[dtype], aligned, *_tables(rows, counts, device))
                         for (dtype, aligned), (rows, counts) in launches.items()]

    def __call__(self) -> None:
        br, bc = self.fp8.block
        for src, aligned, table, owners, firsts, blocks in self.launches:
            if blocks:
                self.kernel[(blocks,)](table, owners, firsts, SRC=src, BR=br, BC=bc, PR=_pow2(br),
                                       PC=_pow2(bc), UE8M0=self.fp8.scale_fmt == "ue8m0", MAX=FP8_MAX, FLOOR=MIN_AMAX,
                                       ALIGNED=aligned, STEP=self.step, num_warps=self.num_warps)


def _forms(jobs: Sequence[CastJob]) -> list[list[CastJob]]:
    """The jobs in groups of one form: source dtype, shape and strides, values' shape and strides, scales' dtype,
    size and contiguity (a layer's experts of one projection): what the checks, the row layout and all but the
    addresses of a job's table row depend on."""
    forms: dict[tuple, list[CastJob]] = {}
    for job in jobs:
        src, values, scales = job.source, job.values, job.scales
        key = (src.dtype, src.shape, src.stride(), values.dtype, values.shape, values.stride(), scales.dtype,
               scales.numel(), scales.is_contiguous())
        forms.setdefault(key, []).append(job)
    return list(forms.values())


def _form_rows(form: list[CastJob], fp8: BlockFP8) -> list[tuple[bool, list[int], int]]:
    """Per job of one form (:func:`_forms`): whether it takes the kernel's fast form (:func:`takes_aligned`), its
    table row (addresses, row strides and columns divided by 16 where it does), and its number of blocks. The
    form's checks and layout are made once."""
    first = form[0]
    grid = fp8.scale_shape(tuple(first.values.shape))
    _check(first, grid)
    n, m = first.values.shape
    layout = _layout(first.source)
    outer, inner_rows, inner, step = layout
    shaped = _aligned_form((n, m), layout, fp8)
    out = []
    for job in form:
        src, values = job.source.data_ptr(), job.values.data_ptr()
        aligned = shaped and src % 16 == 0 and values % 16 == 0
        u = 16 if aligned else 1
        out.append((aligned, [src // u, outer // u, inner // u, step, inner_rows, n, m // u, values // u,
                              job.scales.data_ptr(), grid[1]], grid[0] * grid[1]))
    return out


def _tables(rows: list[list[int]], counts: list[int], device: torch.device) -> tuple[Tensor, Tensor, Tensor, int]:
    """One launch's tables on ``device``: the jobs' rows, each block's job, each job's first block, and the number
    of blocks."""
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    count = torch.tensor(counts, dtype=torch.int64)
    firsts = (count.cumsum(0) - count).to(device)
    owners = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32), count).to(device)
    return table, owners, firsts, int(count.sum())


def takes_aligned(source: Tensor, shape: tuple[int, ...], values_at: int, fp8: BlockFP8) -> bool:
    """Whether quantizing ``source`` into values of ``shape`` at address ``values_at`` takes the kernel's fast form:
    whole blocks (of powers of two) that each lie in one run of rows one stride apart, rows contiguous, and the
    addresses of source and values and the row strides multiples of 16 (vector loads and stores, no division per
    row)."""
    return (_aligned_form((shape[0], shape[1]), _layout(source), fp8) and source.data_ptr() % 16 == 0
            and values_at % 16 == 0)


def _aligned_form(shape: tuple[int, int], layout: tuple[int, int, int, int], fp8: BlockFP8) -> bool:
    """:func:`takes_aligned` but for the addresses."""
    (rows, cols), (outer, inner_rows, inner, step) = shape, layout
    br, bc = fp8.block
    return (br == _pow2(br) and bc == _pow2(bc) and rows % br == 0 and cols % bc == 0 and cols % 16 == 0
            and inner_rows % br == 0 and step == 1 and outer % 16 == 0 and inner % 16 == 0)


def warm_kernel(forms: set[tuple[torch.dtype, bool]], fp8: BlockFP8, device: torch.device) -> None:
    """Compile the kernel's variants for ``forms`` (each a source dtype, and whether it takes the fast form:
    :func:`takes_aligned`) on ``device``, by quantizing one small tensor of each form (a first launch of a
    variant compiles it, a second or more)."""
    if not available(device):
        return
    br, bc = fp8.block
    for dtype, aligned in sorted(forms, key=str):
        rows, cols = (br, bc) if aligned else (br + 1, bc + 1)  # (a partial block: the general form)
        source = torch.ones(rows, cols, dtype=dtype, device=device)
        values = torch.empty(rows, cols, dtype=FP8, device=device)
        scales = torch.empty(fp8.scale_shape((rows, cols)), dtype=torch.float32, device=device)
        BlockCast([CastJob(source, values, scales)], fp8)()


def row_layout(t: Tensor) -> tuple[int, int, int, int] | None:
    """The rows of ``t`` (its dimensions but the last, flattened) as ``(outer stride, inner rows, inner stride,
    column stride)``: row ``r`` starts at ``(r // inner rows) * outer stride + (r % inner rows) * inner stride``.
    A 2-D tensor has one inner dimension; a view that cuts heads out of a fused projection (``[groups, heads, head
    dim, hidden]``) merges into two. None where the rows need more than two strides."""
    merged: list[tuple[int, int]] = []
    for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    step = t.stride(-1) if t.dim() else 1
    if len(merged) > 2:
        return None
    if len(merged) < 2:
        size, stride = merged[0] if merged else (1, 0)
        return 0, size, stride, step
    (_, outer), (inner_rows, inner) = merged
    return outer, inner_rows, inner, step


def _layout(source: Tensor) -> tuple[int, int, int, int]:
    layout = row_layout(source)
    if layout is None:
        raise ValueError(f"a source of shape {tuple(source.shape)} and strides {source.stride()} has rows "
                         "that take more than two strides")
    return layout


def _check(job: CastJob, grid: tuple[int, int]) -> None:
    values, source = job.values, job.source
    if not (values.is_contiguous() and job.scales.is_contiguous()):
        raise ValueError("block FP8 casts write contiguous values and scales")
    if values.dtype != FP8 or values.dim() != 2 or values.numel() != source.numel() or (
            source.dim() and values.shape[1] != source.shape[-1]):
        raise ValueError(f"values must be 2-D float8_e4m3fn with the columns of a source of shape "
                         f"{tuple(source.shape)}, got {values.dtype} {tuple(values.shape)}")
    if job.scales.dtype != torch.float32 or job.scales.numel() != grid[0] * grid[1]:
        raise ValueError(f"scales must be float32 with {grid[0] * grid[1]} elements, got {job.scales.dtype} "
                         f"x {job.scales.numel()}")
