"""The receiver layer's pure parts: a receive's plan and the buckets it names, the copy programs cut out of a real
model's parameters (their batched copies, bit for bit), checksums, the bytes held for deltas, and the names the
engine's commands go by."""

from __future__ import annotations

import pytest
import torch

from weightstream.receiver.deltas import HeldDeltas
from weightstream.receiver.plan import (
    DenseBucket,
    IpcReceive,
    RankBucket,
    Receive,
    ReceivePlan,
    TensorReceive,
    Transport,
)
from weightstream.receiver.programs import (
    ChecksumError,
    copy_program,
    dense_layout,
    verify_checksum,
    wire_meta,
)
from weightstream.receiver.requests import InitGroupRequest
from weightstream.reference_engine.protocol import Shutdown, name_of
from weightstream.streaming.bucket import Shard, TensorMeta
from weightstream.streaming.delta import encode
from weightstream.wire.handles import checksum

pytestmark = pytest.mark.unit

DENSE = DenseBucket(("a", "b"), ("bfloat16", "float32"), ((2, 3), (4,)))
PART = RankBucket(1, ({"name": "a", "dtype": "bfloat16", "shape": [2, 3], "offset": 0},), 12)


def test_a_plan_declares_how_a_receive_goes():
    plan = ReceivePlan(Transport.P2P, ahead=True, delta=True)
    assert (plan.transport, plan.ahead, plan.delta) == (Transport.P2P, True, True)
    assert ReceivePlan(Transport.BROADCAST) == ReceivePlan(Transport.BROADCAST, ahead=False, delta=False)
    assert IpcReceive("p", 3, "ch", "c", 5.0, delta=True).receive_plan == ReceivePlan(Transport.IPC, True, True)
    with pytest.raises(ValueError, match="an IPC receive names its buckets ahead"):
        ReceivePlan(Transport.IPC)


def test_a_receive_lists_every_problem_of_its_buckets_at_once():
    with pytest.raises(ValueError) as caught:
        Receive(ReceivePlan(Transport.BROADCAST), "g", (PART, DENSE))
    assert str(caught.value) == ("bad receive: bucket 0 is a RankBucket, not a DenseBucket; 2 buckets in a receive "
                                 "of one bucket per request")
    with pytest.raises(ValueError) as caught:
        Receive(ReceivePlan(Transport.PIECES, ahead=True), "g", ((PART, DENSE), PART))
    assert str(caught.value) == ("bad receive: bucket 1 is a RankBucket, not a tuple; bucket 0: its parts must be "
                                 "RankBuckets")
    with pytest.raises(ValueError, match=r"^bad receive: ipc is not received over a group$"):
        Receive(ReceivePlan(Transport.IPC, ahead=True), "g", ())
    ok = Receive(ReceivePlan(Transport.PIECES, ahead=True), "g", ((PART, PART), ()))
    assert ok.buckets == ((PART, PART), ()) and ok.load_format == "flattened_bucket"


def test_dense_buckets_are_kept_by_their_layout():
    assert DENSE.key == (("a", "b"), ("bfloat16", "float32"), ((2, 3), (4,)))
    assert DenseBucket(*DENSE.key, checksum="x").key == DENSE.key


def test_commands_are_named_by_their_type_and_a_receive_by_its_plan():
    assert name_of(InitGroupRequest("h", 1, 1, 2, "g", "gloo", 1.0)) == "init_group"
    assert name_of(Shutdown()) == "shutdown"
    assert name_of(TensorReceive("payload")) == "tensor_receive"
    assert name_of(Receive(ReceivePlan(Transport.P2P, ahead=True, delta=True), "g", (PART,))) == \
        "receive (p2p, ahead, delta)"
    assert name_of(Receive(ReceivePlan(Transport.BROADCAST), "g", (DENSE,))) == "receive (broadcast)"


def test_the_dense_layout_is_back_to_back_and_refuses_a_misaligned_tensor():
    metas = dense_layout(*DENSE.key)
    assert metas == [TensorMeta("a", torch.bfloat16, (2, 3), 0), TensorMeta("b", torch.float32, (4,), 12)]
    with pytest.raises(ValueError, match=r"^b: starts at byte 2, not a multiple of its torch.float32 size$"):
        dense_layout(["a", "b"], ["bfloat16", "float32"], [[1], [1]])
    shard = {"name": "w", "dtype": "float32", "shape": [2], "offset": 8,
             "shard": {"dim": 0, "start": 2, "length": 2, "full": 4}}
    assert wire_meta(shard) == TensorMeta("w", torch.float32, (2,), 8, Shard(0, 2, 2, 4))


def test_a_copy_program_cuts_the_buffer_into_its_targets_bit_for_bit():
    a, b = torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(4)
    metas = dense_layout(*DENSE.key)
    program = copy_program(metas, [a.view(-1), b.view(-1)], key=DENSE.key)
    assert (program.total, program.names, program.key) == (28, ("a", "b"), DENSE.key)
    want_a, want_b = torch.randn(2, 3).to(torch.bfloat16), torch.randn(4)
    raw = torch.cat([want_a.view(-1).view(torch.uint8), want_b.view(torch.uint8)])
    for copy in program.copies_from(raw, kept=True):
        copy()
    assert torch.equal(a.view(torch.int16), want_a.view(torch.int16))
    assert torch.equal(b.view(torch.int32), want_b.view(torch.int32))
    assert list(program.copies) == [raw.data_ptr()]  # made once for a kept buffer
    assert program.copies_from(raw, kept=True) is program.copies[raw.data_ptr()]
    unloadable = copy_program(metas, None)
    assert (unloadable.runs, unloadable.names, unloadable.targets, unloadable.total) == (None, (), (), 28)


def test_a_checksum_that_differs_is_refused_naming_the_bucket():
    raw = torch.arange(16, dtype=torch.uint8)
    verify_checksum(raw, checksum(raw), "bucket 3")
    verify_checksum(raw, None, "bucket 3")
    with pytest.raises(ChecksumError) as caught:
        verify_checksum(raw, "0" * 16, "bucket 3", lambda: "; its tensors: ['a']")
    assert str(caught.value) == (f"bucket 3 arrived corrupted (checksum {checksum(raw)} != sender's "
                                 "0000000000000000); nothing of it was loaded; its tensors: ['a']")


def test_the_bytes_held_for_deltas_take_each_payload_and_forget_on_abort():
    layout = tuple(dense_layout(["w"], ["float32"], [[8]]))
    first, second = torch.randn(8), torch.randn(8)
    second[:5] = first[:5]
    held = HeldDeltas(limit=1 << 10)
    held.begin()
    old = first.view(torch.uint8).clone()
    dense, payload = encode(old, torch.zeros(32, dtype=torch.uint8), 4, ("dense",))
    raw = held.new_bytes(0, layout, 32, dense, payload, checksum(payload))
    assert torch.equal(raw[:32], old) and len(held) == 1 and held.changed
    new = second.view(torch.uint8).clone()
    header, payload = encode(new, old, 4, ("indices",))
    assert held.new_bytes(0, layout, 32, header, payload, None) is raw and torch.equal(raw[:32], new)
    assert held.checksums() == {0: checksum(new)}
    with pytest.raises(ValueError, match=r"^delta bucket 1: this engine holds no bytes of that bucket"):
        held.new_bytes(1, layout, 32, header, payload, None)
    with pytest.raises(ChecksumError, match=r"^delta bucket 0 arrived corrupted"):
        held.new_bytes(0, layout, 32, header, payload, "0" * 16)
    held.abort()
    assert len(held) == 0 and held.checksums() == {}


def test_the_bytes_held_for_deltas_stay_only_once_committed():
    """A committed session's bytes stay for the next session (with no version where the engine names it elsewhere,
    as the reference engine's server does; as the version its commit names otherwise); bytes a session changed that
    neither a commit nor a rollback settled are dropped when the next session opens; a bound not yet set refuses."""
    layout = tuple(dense_layout(["w"], ["float32"], [[8]]))
    dense, payload = encode(torch.arange(32, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8), 4, ("dense",))
    with pytest.raises(RuntimeError, match=r"^delta bucket 0: no bound is set on the bytes held for deltas$"):
        HeldDeltas().new_bytes(0, layout, 32, dense, payload.clone(), None)
    held = HeldDeltas(limit=48)
    for version, kept in ((None, None), ("v1", "v1")):
        held.begin()
        raw = held.new_bytes(0, layout, 32, dense, payload.clone(), None)
        held.commit(version)
        held.begin()
        assert (held.held, held.version, held.changed) == ({0: (layout, raw)}, kept, False)
    held.new_bytes(0, layout, 32, dense, payload.clone(), None)
    with pytest.raises(ValueError, match=r"^delta bucket 1: the bytes held for deltas would exceed 48 "):
        held.new_bytes(1, layout, 32, dense, payload.clone(), None)
    held.begin()  # the last session was neither committed nor rolled back
    assert (held.held, held.version, held.nbytes) == ({}, None, 0)
