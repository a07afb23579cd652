"""A bucket packed into one of the stream's two kept buffers (``reuse_buffers``) has zero alignment gaps, whatever
the bucket packed there before left: its bytes, its checksum and its delta against the engine's copy depend on
its tensors alone."""

from __future__ import annotations

import pytest
import torch

from tests.test_reshard_plan import DIMS, trainer_bucket
from weightstream.models.presets import preset_config, random_hf_model
from weightstream.sinks.reshard import _packed
from weightstream.streaming.bucket import Bucket, TensorMeta, extent, gap_ranges
from weightstream.streaming.delta import Snapshot
from weightstream.streaming.kept_plans import clear_plans
from weightstream.streaming.reshard import EngineLayout, plan_bucket
from weightstream.streaming.stream import stream_hf_weights
from weightstream.wire.fp8 import BlockFP8
from weightstream.wire.handles import checksum

pytestmark = pytest.mark.unit

SMALL = 60_000  # bytes per bucket: the tiny model travels in many buckets of different layouts
FP8 = BlockFP8(block=(16, 16))  # divides every dimension of the tiny presets
# On a GPU the flat copies are one launch (PieceCopy) and block FP8 is cast by its kernel: the gaps the same.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def _gap_mask(bucket: Bucket) -> torch.Tensor:
    """True at every byte of ``bucket`` that no tensor covers."""
    gap = torch.ones(bucket.nbytes, dtype=torch.bool, device=bucket.buffer.device)
    for m in bucket.metas:
        gap[m.offset:m.offset + m.nbytes] = False
    return gap


def _fresh(model: torch.nn.Module, cfg, quantize: BlockFP8 | None) -> list[tuple[bytes, str]]:
    """Every bucket's bytes and checksum packed into a new, zeroed buffer each."""
    return [(b.buffer.cpu().numpy().tobytes(), checksum(b.buffer))
            for b in stream_hf_weights(model, cfg, bucket_bytes=SMALL, reuse_buffers=False, quantize=quantize)]


def test_gap_ranges_are_the_bytes_no_tensor_covers():
    metas = [TensorMeta("b", torch.bfloat16, (5,), 256), TensorMeta("a", torch.int8, (3,), 0),
             TensorMeta("c", torch.float32, (64,), 512), TensorMeta("empty", torch.float32, (0,), 768)]
    assert gap_ranges(metas, 800) == ((3, 253), (266, 246), (768, 32))
    assert gap_ranges(metas[2:3], 768) == ((0, 512),)
    assert gap_ranges([TensorMeta("a", torch.int8, (256,), 0)], 256) == ()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantize", [None, FP8], ids=["bf16", "block-fp8"])
def test_kept_buffer_gaps_are_zero_whatever_the_last_bucket_left(quantize, device):
    """Bucket B packed where bucket A (another layout) was: B's gaps, which A's tensors covered, are zero, and
    B's bytes and checksum are those of a fresh pack. Then with every byte of the buffer set to 0xFF before
    each pack: the same."""
    clear_plans()
    cfg = preset_config("tiny-qwen3")
    model = random_hf_model(cfg, seed=5, dtype=torch.bfloat16).to(device)
    fresh = _fresh(model, cfg, quantize)
    covered = 0  # bucket bytes in gaps that the last bucket in the buffer had left non-zero
    for dirty in (False, True, False):
        stream = stream_hf_weights(model, cfg, bucket_bytes=SMALL, reuse_buffers=True, quantize=quantize)
        kept = stream.kept_buffers()
        assert len(stream) == len(fresh) > 4 and len(kept) == 2
        for i in range(len(stream)):
            slot = kept[i % 2]
            if dirty:
                slot.fill_(0xFF)
            before = slot.clone()
            bucket = next(stream)
            assert bucket.kept and bucket.buffer.data_ptr() == slot.data_ptr()
            gap = _gap_mask(bucket)
            covered += int((before[:bucket.nbytes][gap] != 0).sum())
            assert int(bucket.buffer[gap].ne(0).sum()) == 0, (dirty, i)
            assert (bucket.buffer.cpu().numpy().tobytes(), checksum(bucket.buffer)) == fresh[i], (dirty, i)
        if dirty:  # a later stream: the copies and the gaps' zeroing kept with the plan, none made again
            assert stream.stats.copy_programs == 0
    assert covered > 0  # the tiny model's buckets do differ in layout where the buffers are shared


def test_a_step_that_changes_one_tensor_leaves_every_other_bucket_without_a_changed_word():
    """Deltas of kept-buffer packs against the snapshot of the last: after a step that changes one tensor only,
    the bucket holding it has changed words and every other bucket none."""
    clear_plans()
    cfg = preset_config("tiny-qwen3")
    model = random_hf_model(cfg, seed=6, dtype=torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    snapshot = Snapshot()
    for step in range(5):
        changed = names[(5 * step + 3) % len(names)]
        if step:
            with torch.no_grad():
                dict(model.named_parameters())[changed].view(-1).view(torch.int16)[:4] ^= 1
        snapshot.begin(full=step == 0)
        holders = []
        for bucket in stream_hf_weights(model, cfg, bucket_bytes=SMALL, reuse_buffers=True):
            header, _ = snapshot.encode(bucket.index, bucket.buffer, bucket.word)
            if header.count and step:
                holders.append((bucket.index, header.count, [m.name for m in bucket.metas]))
        if step:
            ((_, count, held),) = holders
            assert count == 4 and changed in held


def test_a_resharded_route_packed_into_dirty_memory_has_zero_gaps(monkeypatch):
    """TP 2 into TP 4: each route's pieces are cut into a buffer of their own; its gaps are zero whatever memory
    it gets, so a delta of the route's bytes carries changed pieces only."""
    senders = [trainer_bucket(2, r) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    buckets = [Bucket(0, torch.randint(0, 256, (extent(m),), dtype=torch.uint8, generator=g), tuple(m))
               for m in senders]
    cut = [r for r in plan_bucket(senders, EngineLayout(4, DIMS)) if not r.whole_bucket]
    clean = [_packed(buckets[r.sender], r) for r in cut]
    empty = torch.empty

    def dirty(*args, **kwargs):  # memory as a reused allocation hands it out: every byte set
        return empty(*args, **kwargs).fill_(0xFF) if kwargs.get("dtype") == torch.uint8 else empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", dirty)
    packed = [_packed(buckets[r.sender], r) for r in cut]
    assert len(cut) == 6 and any(gap_ranges(r.metas, got.numel()) for r, got in zip(cut, packed, strict=True))
    for r, got, want in zip(cut, packed, clean, strict=True):
        assert torch.equal(got, want) and checksum(got) == checksum(want)
        assert all(int(got[start:start + n].ne(0).sum()) == 0 for start, n in gap_ranges(r.metas, got.numel()))
