"""Bucket planning, as a pure function of sizes."""

from __future__ import annotations

import itertools

import pytest

from weightstream.common.layout import layout, round_up
from weightstream.streaming.plan import plan_buckets

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset


def flat(plans):
    return [list(p.items) for p in plans]


def test_order_kept_and_limit_respected():
    items = [[100], [200], [50], [300], [10]]
    plans = plan_buckets(items, limit=400, align=1)
    assert flat(plans) == [[0, 1, 2], [3, 4]]
    assert [p.nbytes for p in plans] == [350, 310]
    assert [p.index for p in plans] == [0, 1]
    assert all(p.nbytes <= 400 for p in plans)


def test_alignment_counts_toward_the_limit():
    items = [[10], [10], [10]]
    plans = plan_buckets(items, limit=300, align=256)
    # offsets 0 and 256; the third would start at 512 > 300.
    assert flat(plans) == [[0, 1], [2]]
    assert plans[0].offsets == ((0,), (256,))
    assert plans[0].nbytes == 266


def test_oversize_item_goes_alone():
    items = [[10], [1000], [10], [10]]
    plans = plan_buckets(items, limit=100, align=1)
    assert flat(plans) == [[0], [1], [2, 3]]
    assert plans[1].nbytes == 1000


def test_multi_tensor_items_stay_together():
    items = [[40, 40, 40], [30], [60, 60]]
    plans = plan_buckets(items, limit=130, align=1)
    assert flat(plans) == [[0], [1], [2]]  # 120 + 30 > 130
    assert plans[0].offsets == ((0, 40, 80),)


def test_every_item_exactly_once_and_in_order():
    sizes = [[(i * 37) % 500 + 1] for i in range(1000)]
    plans = plan_buckets(sizes, limit=4096, align=64)
    seen = [i for p in plans for i in p.items]
    assert seen == list(range(1000))
    for p in plans:
        assert p.nbytes <= 4096
        for (off,), _item in zip(p.offsets, p.items, strict=True):
            assert off % 64 == 0
    # Greedy: no bucket could have taken the next item.
    for a, b in itertools.pairwise(plans):
        first = sizes[b.items.start][0]
        assert round_up(a.nbytes, 64) + first > 4096


def test_hundreds_of_small_tensors_pack_many_per_bucket():
    items = [[2048] for _ in range(600)]  # e.g. 600 small expert tensors
    plans = plan_buckets(items, limit=1 << 20, align=256)
    assert len(plans) == 2 and len(plans[0].items) == 512


def test_layout_and_errors():
    offsets, end = layout([[3], [5, 7]], align=4)
    assert offsets == [(0,), (4, 12)] and end == 19
    assert plan_buckets([], limit=10) == []
    with pytest.raises(ValueError):
        plan_buckets([[1]], limit=0)
    with pytest.raises(ValueError):
        plan_buckets([[1]], limit=10, align=3)
