"""Delta encodings (``weightstream.streaming.delta``): bit-exact by construction, their sizes as declared, the
smallest chosen, bad payloads refused naming every problem; the sender's snapshot over real Adam steps."""

from __future__ import annotations

import pytest
import torch

from weightstream.receiver.schema import delta_problems
from weightstream.streaming.delta import (
    DeltaHeader,
    Snapshot,
    apply,
    choose,
    encode,
    encoded_bytes,
    word_size,
)
from weightstream.wire.handles import checksum


def _bf16_pair(n: int, changed: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two flat uint8 views of ``n`` bf16 values, of which ``changed`` (at random places) differ."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g).to(torch.bfloat16)
    new = old.clone()
    where = torch.randperm(n, generator=g)[:changed]
    new[where] = (new[where].float() + 1.0).to(torch.bfloat16)
    return old.view(torch.uint8), new.view(torch.uint8)


@pytest.mark.unit
@pytest.mark.parametrize("encoding", ["indices", "bitmap", "dense"])
@pytest.mark.parametrize("changed", [0, 1, 37, 500, 4096])
def test_encode_apply_bit_exact(encoding, changed):
    old, new = _bf16_pair(4096, changed)
    header, payload = encode(new, old, 2, (encoding,))
    if encoding != "dense" and choose(2048 * 2, changed, 2, (encoding,)) == "dense":
        assert header.encoding == "dense"  # the delta would be larger: dense
    assert header.count == changed
    assert payload.numel() == header.nbytes == encoded_bytes(header.encoding, 4096, changed, 2)
    held = old.clone()
    assert torch.equal(apply(held, header, payload), new)
    assert torch.equal(held, new) and checksum(held) == checksum(new)


@pytest.mark.unit
@pytest.mark.parametrize("words", [16, 20, 4100])
def test_bitmap_of_any_length_applies(words):
    """A bitmap of an odd number of bytes (20 words: 3) leaves the values after it at an odd offset: they apply
    all the same."""
    old, new = _bf16_pair(words, words // 3 + 1, seed=words)
    header, payload = encode(new, old, 2, ("bitmap",))
    assert header.encoding == "bitmap" or words == 4100
    assert torch.equal(apply(old.clone(), header, payload), new)


@pytest.mark.unit
def test_sizes_and_choice():
    # 4096 bf16 words: indices 6 bytes per change, bitmap 512 bytes + 2 per change, dense 8192
    assert [encoded_bytes(e, 4096, 100, 2) for e in ("indices", "bitmap", "dense")] == [600, 712, 8192]
    assert choose(4096, 100, 2) == "indices"
    assert choose(4096, 128, 2) == "indices"  # 768 == 768: the tie goes to the first one listed after dense
    assert choose(4096, 129, 2) == "bitmap"  # more than one word in 32
    assert choose(4096, 3841, 2) == "dense"  # 512 + 7682 > 8192
    assert choose(4096, 0, 2) == "indices"  # nothing changed: an empty payload
    assert choose(4096, 100, 2, ("dense",)) == "dense"
    assert word_size(4096, [2, 4]) == 2 and word_size(4096, [4]) == 4 and word_size(4097, [1, 2]) == 1
    assert word_size(4098, [4]) == 1 and word_size(8, [8]) == 4


@pytest.mark.unit
def test_words_of_four_and_one_byte():
    g = torch.Generator().manual_seed(3)
    old = torch.randn(1000, generator=g)
    new = old.clone()
    new[[3, 500, 999]] += 1e-7  # changes below bf16's step: float32 words see them
    for word in (4, 1):
        header, payload = encode(new.view(torch.uint8), old.view(torch.uint8), word)
        assert header.word == word and 3 <= header.count <= 12
        assert torch.equal(apply(old.view(torch.uint8).clone(), header, payload).view(torch.float32), new)


@pytest.mark.unit
def test_bad_delta_refused_naming_every_problem():
    old, new = _bf16_pair(64, 5)
    header, payload = encode(new, old, 2, ("indices",))
    bad = DeltaHeader("indices", 2, 100, header.count, header.nbytes + 4)
    with pytest.raises(ValueError) as err:
        apply(old.clone(), bad, payload)
    assert "held bucket has 128 bytes, the delta is of 100" in str(err.value)
    assert f"payload has {payload.numel()} bytes, the header says {header.nbytes + 4}" in str(err.value)
    wild = payload.clone()
    wild[:4] = 0xFF  # the first position: -1
    with pytest.raises(ValueError, match="positions outside the bucket's 64 words"):
        apply(old.clone(), header, wild)
    with pytest.raises(ValueError, match="same bucket"):
        encode(new, old[:-2], 2)


@pytest.mark.unit
@pytest.mark.parametrize("where", ["device", "host"])
def test_snapshot_full_then_deltas(where):
    snap = Snapshot(where)
    old, new = _bf16_pair(2048, 20)
    snap.begin(full=False)  # nothing held yet: full anyway
    header, payload = snap.encode(0, old, 2)
    assert snap.full and header.encoding == "dense" and payload is old and snap.nbytes == old.numel()
    assert snap.digests == {0: checksum(old)}
    snap.begin(full=False)
    header, payload = snap.encode(0, new, 2)
    assert (header.encoding, header.count, payload.numel()) == ("indices", 20, 120)
    assert torch.equal(snap.held[0], new) and snap.held[0].data_ptr() != new.data_ptr()
    assert snap.digests == {0: checksum(new)}
    snap.begin(full=False)
    header, payload = snap.encode(0, new, 2)
    assert (header.count, payload.numel()) == (0, 0)
    snap.forget()
    snap.begin(full=False)
    assert snap.full and snap.encode(0, new, 2)[0].encoding == "dense"


@pytest.mark.unit
def test_snapshot_over_real_adam_steps():
    """Adam on fp32 masters, copied to bf16 after each step: 20 deltas applied to the engine's bytes in turn
    give the trainer's bf16 bytes bit for bit, and the deltas are a fraction of the bytes."""
    torch.manual_seed(0)
    master = torch.nn.Linear(128, 128)
    opt = torch.optim.Adam(master.parameters(), lr=1e-5)
    x = torch.randn(16, 128)
    snap, engine = Snapshot(), torch.empty(0, dtype=torch.uint8)
    sent = dense = 0
    for step in range(20):
        bucket = torch.cat([p.detach().to(torch.bfloat16).reshape(-1) for p in master.parameters()]).view(torch.uint8)
        snap.begin(full=step == 0)
        header, payload = snap.encode(0, bucket, 2)
        engine = payload.clone() if step == 0 else apply(engine, header, payload.clone())
        assert torch.equal(engine, bucket) and snap.digests[0] == checksum(engine)
        sent, dense = sent + (payload.numel() if step else 0), dense + (bucket.numel() if step else 0)
        master(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert 0 < sent < dense / 2


@pytest.mark.unit
def test_engine_refuses_a_bad_delta_header_naming_every_problem():
    good = {**DeltaHeader("bitmap", 2, 4096, 10, 276).as_json(), "index": 3}
    assert delta_problems(good) == [] and delta_problems(None) == []
    assert delta_problems({**good, "encoding": "zstd", "index": -1}) == [
        "weightstream_delta.index must be a non-negative integer",
        "weightstream_delta.encoding must be one of ['dense', 'indices', 'bitmap'], got 'zstd'"]
    assert delta_problems({**good, "word": 3, "count": 5000}) == [
        "weightstream_delta.word must be 1, 2 or 4 and divide total 4096",
        "weightstream_delta.count 5000 exceeds the bucket's words"]
    assert delta_problems([1]) == ["field 'weightstream_delta' must be an object"]


@pytest.mark.unit
@pytest.mark.parametrize("encoding,changed", [("dense", 512), ("indices", 3), ("bitmap", 200)])
def test_header_words_round_trip_and_a_bad_one_names_every_problem(encoding, changed):
    """A header as it crosses the wire ahead of its payload (``delta_ahead``) reads back as itself and its bucket's
    index; one that cannot be is refused before its payload is received, every field named."""
    header = DeltaHeader(encoding, 2, 1024, changed, encoded_bytes(encoding, 512, changed, 2))
    assert DeltaHeader.from_words(header.as_words(7), 1024, 1024) == (header, 7)
    with pytest.raises(ValueError) as err:
        DeltaHeader.from_words([9, 3, 100, 5, 4096, 7], 1024, 1024)
    assert str(err.value) == ("bad delta header for bucket 7: encoding 9 is none of [0, 1, 2] (dense, indices, "
                              "bitmap); word of 3 bytes (1, 2 or 4); 100 bucket bytes, its tensors take 1024; a "
                              "payload of 4096 bytes (at most 1024)")
    with pytest.raises(ValueError, match="bucket 7: 90 payload bytes, indices of 3 words takes 18"):
        DeltaHeader.from_words([1, 2, 1024, 3, 90, 7], 1024, 1024)
