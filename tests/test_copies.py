"""The piece table of :class:`weightstream.streaming.copies.PieceCopy` (the GPU kernel reads it; the GPU
check in tools/gpu_jobs.py runs the kernel): applied here byte for byte with memmove, it reproduces every
copy exactly, in pieces of at most the piece size, in the widest element size that divides every address."""

from __future__ import annotations

import ctypes

import pytest
import torch

from weightstream.streaming.copies import plan_pieces

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset


def _apply(unit: int, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
    for s, d, n in zip(srcs, dsts, lens, strict=True):
        ctypes.memmove(d, s, n * unit)


@pytest.mark.parametrize("dtype,shift", [(torch.bfloat16, 0), (torch.bfloat16, 1), (torch.float32, 1), (torch.int8, 1)])
def test_pieces_reproduce_every_copy(dtype, shift):
    gen = torch.Generator().manual_seed(5)
    pool = (torch.rand(200_000, generator=gen) * 100).to(dtype)  # sources: views at odd places of one storage
    sizes = [1, 7, 4096, 100_003, 3, 50_000]
    src, at = [], shift
    for n in sizes:
        src.append(pool[at:at + n])
        at += n + 5
    out = torch.zeros(sum(sizes) + 64, dtype=dtype)
    dst, at = [], shift
    for n in sizes:
        dst.append(out[at:at + n])
        at += n + 3
    unit, srcs, dsts, lens = plan_pieces(dst, src, piece_bytes=1000)
    # Shifted by one element, the views share no wider alignment than their element size.
    assert unit == dtype.itemsize if shift else unit >= dtype.itemsize
    assert all(a % unit == 0 for a in srcs + dsts) and max(lens) * unit <= 1000
    assert sum(lens) * unit == sum(sizes) * dtype.itemsize
    _apply(unit, srcs, dsts, lens)
    for d, s in zip(dst, src, strict=True):
        assert torch.equal(d.view(torch.uint8), s.view(torch.uint8))
    gaps = torch.ones(out.numel(), dtype=torch.bool)
    at = shift
    for n in sizes:
        gaps[at:at + n] = False
        at += n + 3
    assert (out[gaps].float() == 0).all()  # nothing written outside the destinations


def test_pieces_refuse_strided_pairs():
    a = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="contiguous"):
        plan_pieces([a[:, 0]], [torch.zeros(4)])


@pytest.mark.unit
def test_a_strided_view_is_copied_as_its_contiguous_slabs_in_dense_order():
    from weightstream.streaming.programs import contiguous_slabs

    fused = torch.arange(4 * 10 * 6, dtype=torch.float32).view(4, 10, 6)  # 4 groups of q (6 rows), k (2), v (2)
    q = fused.narrow(1, 0, 6)
    slabs = contiguous_slabs(q, min_bytes=0)
    assert slabs is not None and len(slabs) == 4 and all(s.is_contiguous() for s in slabs)
    assert torch.equal(torch.cat([s.reshape(-1) for s in slabs]), q.reshape(-1))
    assert contiguous_slabs(fused.narrow(1, 6, 2), min_bytes=0) is not None
    assert contiguous_slabs(q, limit=3, min_bytes=0) is None
    assert contiguous_slabs(q) is None  # slabs of 144 bytes: one strided copy moves them better
    cut = fused[:, :, :3]  # rows cut short: runs of 3 elements
    assert contiguous_slabs(cut, min_bytes=12) is not None and contiguous_slabs(cut, min_bytes=13) is None
    assert contiguous_slabs(fused) == [fused]
