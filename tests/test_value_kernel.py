"""The pieces the one-launch value check looks at (weightstream.receiver.value_kernel.plan_checks), on any machine:
every byte of every floating-point tensor in exactly one piece of its kind, stretches of one dtype joined, scales
apart, long stretches cut; the kernel itself runs on a GPU (tools/gpu_check_values.py compares it with the torch
path there, flag for flag)."""

from __future__ import annotations

import struct

import pytest
import torch

from weightstream.receiver.value_kernel import KINDS, PIECE_BYTES, SCALE, plan_checks
from weightstream.receiver.values import MAX_FP8_SCALE
from weightstream.streaming.bucket import typed_runs
from weightstream.streaming.value_checks import MAX_SCALE_BITS
from weightstream.wire.fp8 import SCALE_SUFFIX

pytestmark = pytest.mark.unit


def _runs(tensors: list[tuple[str, torch.dtype, int]], align: int = 8):
    """``(name, dtype, numel)`` laid out back to back at ``align``-byte boundaries, cut into runs."""
    entries, offset = [], 0
    for name, dtype, numel in tensors:
        offset = -(-offset // align) * align
        entries.append((dtype, offset, numel, (name, None)))
        offset += numel * dtype.itemsize
    return typed_runs(entries), entries


def _covered(plan) -> dict[int, int]:
    """byte -> kind, over every piece; no byte in two pieces."""
    width = {0: 2, 1: 2, 2: 4, 3: 1, 4: 4, 5: 1, 6: 8}
    seen: dict[int, int] = {}
    for off, n, kind in zip(plan.offsets, plan.lengths, plan.kinds, strict=True):
        assert n * width[kind] <= PIECE_BYTES
        for b in range(off, off + n * width[kind]):
            assert b not in seen
            seen[b] = kind
    return seen


def test_every_byte_of_every_float_tensor_is_in_one_piece_of_its_kind():
    tensors = [("a.weight", torch.bfloat16, 15), ("a2.weight", torch.bfloat16, 4), ("s.weight", torch.float8_e4m3fn, 9),
               ("s.weight" + SCALE_SUFFIX, torch.float32, 3), ("t.weight", torch.float8_e4m3fn, 16),
               ("t.weight" + SCALE_SUFFIX, torch.float32, 2), ("n.weight", torch.float32, 5),
               ("i.index", torch.int64, 3), ("h.weight", torch.float16, 7), ("e.weight", torch.float8_e5m2, 3)]
    runs, entries = _runs(tensors)
    plan = plan_checks(runs)
    assert plan is not None
    seen = _covered(plan)
    for dtype, offset, numel, (name, _) in entries:
        if not dtype.is_floating_point:
            assert not any(b in seen for b in range(offset, offset + numel * dtype.itemsize))
            continue
        kind = SCALE if name.endswith(SCALE_SUFFIX) else KINDS[dtype]
        assert all(seen[b] == kind for b in range(offset, offset + numel * dtype.itemsize)), name
    # a.weight and a2.weight, back to back in one dtype, are one piece (their padding too); each scale its own
    assert plan.offsets[0] == 0 and plan.lengths[0] * 2 == 40 and plan.kinds[:1] == (KINDS[torch.bfloat16],)
    assert plan.kinds.count(SCALE) == 2


def test_a_long_stretch_is_cut_into_pieces_and_an_unknown_float_leaves_the_bucket_to_torch():
    runs, _ = _runs([("big.weight", torch.bfloat16, PIECE_BYTES + 10), ("b.weight", torch.bfloat16, PIECE_BYTES)])
    plan = plan_checks(runs)
    assert plan is not None
    assert plan.offsets == tuple(k * PIECE_BYTES for k in range(5))
    assert sum(plan.lengths) * 2 == 4 * PIECE_BYTES + 24  # big.weight, 4 bytes of padding, b.weight
    runs, _ = _runs([("c.weight", torch.complex64, 4)])
    assert plan_checks(runs) is not None  # not a float: nothing to look at
    runs, _ = _runs([("q.weight", torch.float8_e4m3fnuz, 4)])
    assert plan_checks(runs) is None


def test_the_largest_scale_is_the_bits_the_kernel_compares_with():
    assert struct.unpack("<i", struct.pack("<f", MAX_FP8_SCALE))[0] == MAX_SCALE_BITS
