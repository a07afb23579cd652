"""The IPC control channel's frames (``weightstream.wire.frames``): every kind goes through JSON and comes back
equal; a frame that is not one of the protocol's (unknown kind, missing field, wrong type, unknown field,
another version) raises one ``FrameError`` naming its kind and every problem; the trainer's side answers one
with an ``UpdateError``; and a live reference engine answers one with an error frame, rolls the update back
and goes on serving."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Callable

import pytest

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.workers import INPUT_IDS, Case, run_update
from tests.test_update import SMALL, engine
from weightstream.engines import EngineError, ReferenceEngine
from weightstream.errors import UpdateError
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.sinks import IPCSink
from weightstream.wire.channel import Channel, Listener
from weightstream.wire.frames import (
    FRAMES,
    PROTOCOL_VERSION,
    BucketLayout,
    BucketLoaded,
    BucketSent,
    BuffersHeld,
    DeltaRecord,
    Descriptors,
    Error,
    Export,
    ExportedWeights,
    Finish,
    Frame,
    FrameError,
    Hello,
    KeptBuffers,
    LentBuffer,
    Offer,
    OfferAnswer,
    Plan,
    Ready,
    WritesApplied,
    WritesDone,
    decode,
    encode,
)

LAYOUT = BucketLayout(names=("model.norm.weight", "lm_head.weight"), dtypes=("float32", "bfloat16"),
                      shapes=((64,), (128, 64)), offsets=(0, 256))

EXAMPLES: list[Frame] = [
    Hello(rank=1, client="c0ffee", have=(0, 3), plan_known=True),
    Offer(direct=False),
    Export(id="e1", weights=ExportedWeights(names=("a", "b"), storages=(0, 0), offsets=(0, 16), numels=(4, 8),
                                            dtypes=("float32", "bfloat16"), sizes=(32,), payload=None)),
    Export(id="e1", weights=None),
    Export(id="e2", weights=ExportedWeights(names=("a",), storages=(0,), offsets=(0,), numels=(4,),
                                            dtypes=("float32",), sizes=None, payload="cGlja2xl", flag=1)),
    Ready(),
    BucketLoaded(k=7),
    WritesApplied(tensors=47),
    BuffersHeld(held=2),
    Plan(buckets=(LAYOUT, BucketLayout(names=(), dtypes=(), shapes=(), offsets=()))),
    OfferAnswer(direct=True, have=None, events=("ZXYw", "ZXYx", "ZXYy", "ZXYz")),
    KeptBuffers(buffers=(LentBuffer(0, fd_bytes=4096), LentBuffer(1, payload="aGFuZGxl"), LentBuffer(2)),
                slots=(0, 1), drop=(5,)),
    KeptBuffers(buffers=(), slots=(), drop=()),
    BucketSent(k=0, buffer=LentBuffer(4, fd_bytes=1 << 20), offset=0, nbytes=123456, keep=True, drop=(0,),
               checksum="abc123", events=("ZXYw",)),
    BucketSent(k=3, buffer=LentBuffer(1), offset=64, nbytes=1024, keep=False),
    BucketSent(k=2, buffer=LentBuffer(5, fd_bytes=4096), offset=0, nbytes=300, keep=False,
               delta=DeltaRecord(index=2, encoding="bitmap", word=2, total=2048, count=20, nbytes=168)),
    WritesDone(),
    WritesDone(checked=True),
    Finish(commit=True),
    Finish(commit=False),
    Error(message="bucket 2 arrived corrupted", bucket=2),
    Error(message="the trainer refused a frame"),
    Descriptors(count=250),
]


def _through_json(frame: Frame) -> Frame:
    return decode(json.loads(json.dumps(encode(frame))))


# -- every kind, both ways -----------------------------------------------------------------------------


@pytest.mark.unit
def test_every_frame_kind_round_trips_through_json():
    assert {type(f).kind for f in EXAMPLES} == set(FRAMES)  # every kind the protocol declares
    for frame in EXAMPLES:
        raw = encode(frame)
        assert raw["v"] == PROTOCOL_VERSION and raw["kind"] == frame.kind
        assert _through_json(frame) == frame, frame


@pytest.mark.unit
def test_a_frame_on_the_wire_is_its_fields_with_the_version_and_kind():
    assert encode(BucketSent(k=1, buffer=LentBuffer(2), offset=8, nbytes=16, keep=True)) == {
        "v": PROTOCOL_VERSION, "kind": "bucket", "k": 1, "buffer": {"id": 2, "payload": None, "fd_bytes": None},
        "offset": 8, "nbytes": 16, "keep": True, "drop": (), "checksum": None, "events": (), "delta": None}


# -- malformed frames ----------------------------------------------------------------------------------

GOOD = encode(BucketSent(k=1, buffer=LentBuffer(2, fd_bytes=64), offset=0, nbytes=64, keep=False))

MALFORMED = {
    "unknown kind": ({**GOOD, "kind": "teleport"}, "teleport", ["unknown kind 'teleport'"]),
    "missing field": ({k: v for k, v in GOOD.items() if k != "nbytes"}, "bucket", ["missing field 'nbytes'"]),
    "wrong type": ({**GOOD, "keep": "yes"}, "bucket", ["field 'keep' must be true or false, got a string"]),
    "negative size": ({**GOOD, "nbytes": -4}, "bucket", ["field 'nbytes' must be a non-negative integer, got -4"]),
    "nested wrong type": ({**GOOD, "buffer": {"id": 2, "payload": 5, "fd_bytes": None}}, "bucket",
                          ["field 'buffer.payload' must be null or a string, got an integer"]),
    "unknown field": ({**GOOD, "priority": 1}, "bucket", ["unknown fields ['priority']"]),
    "unknown nested field": ({**GOOD, "buffer": {"id": 2, "payload": None, "fd_bytes": 64, "x": 0}}, "bucket",
                             ["unknown fields ['x'] in 'buffer'"]),
    "wrong version": ({**GOOD, "v": PROTOCOL_VERSION + 1}, "bucket",
                      [f"protocol version {PROTOCOL_VERSION + 1}: this end speaks version {PROTOCOL_VERSION}"]),
    "bad delta": ({**GOOD, "delta": {"index": 1, "encoding": "zip", "word": 3, "total": 64, "count": 0,
                                     "nbytes": 80}}, "bucket",
                  ["'delta': delta encoding 'zip' is not one of dense, indices, bitmap",
                   "'delta': delta word 3 must be 1, 2 or 4 and divide the bucket's 64 bytes"]),
    "delta past the bytes sent": ({**GOOD, "delta": {"index": 1, "encoding": "indices", "word": 2, "total": 64,
                                                     "count": 20, "nbytes": 120}}, "bucket",
                                  ["the delta's 120 bytes exceed the 64 sent"]),
    "no version": ({k: v for k, v in GOOD.items() if k != "v"}, "bucket", ["protocol version None"]),
    "not an object": ([GOOD], None, ["a frame is a JSON object, got a list"]),
    "a flag among the weights": (encode(Export("e3", ExportedWeights(("a",), (0,), (0,), (4,), ("float32",), None,
                                                                     "cGlja2xl", flag=0))), "export",
                                 ["'weights': the flag (storage 0) is a storage of its own, among the handles (a GPU's "
                                  "export)"]),
    "fields that disagree": (encode(Plan((BucketLayout(("a", "b"), ("float32",), ((1,), (2,)), (0, 4)),))), "plan",
                             ["'buckets[0]': names, dtypes, shapes and offsets differ in length (2, 1, 2, 2)"]),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", list(MALFORMED))
def test_each_malformation_raises_one_frame_error_naming_it(case):
    raw, kind, expected = MALFORMED[case]
    with pytest.raises(FrameError) as caught:
        decode(json.loads(json.dumps(raw)))
    assert caught.value.kind == kind
    if kind is not None:
        assert f"control frame {kind!r}" in str(caught.value)
    for problem in expected:
        assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


@pytest.mark.unit
def test_every_problem_of_a_frame_is_named_at_once():
    raw = {"v": 9, "kind": "hello", "rank": -1, "client": 7, "have": [0, "one", 2.5], "extra": True}
    with pytest.raises(FrameError) as caught:
        decode(raw)
    assert caught.value.kind == "hello"
    assert caught.value.problems == [
        f"protocol version 9: this end speaks version {PROTOCOL_VERSION} (both ends must run the same weightstream)",
        "field 'rank' must be a non-negative integer, got -1",
        "field 'client' must be a string, got an integer",
        "field 'have[1]' must be a non-negative integer, got a string",
        "field 'have[2]' must be a non-negative integer, got a number",
        "missing field 'plan_known'",
        "unknown fields ['extra']",
    ]


# -- on a channel --------------------------------------------------------------------------------------


def _pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Channel(a), Channel(b)


def _send_raw(chan: Channel, raw) -> None:
    """What a peer that is not this protocol's might send: any JSON, length-prefixed."""
    data = json.dumps(raw).encode()
    chan.sock.sendall(struct.pack("!I", len(data)) + data)


@pytest.mark.unit
def test_a_channel_carries_frames_and_their_descriptors():
    here, there = _pair()
    r, w = os.pipe()
    try:
        frame = KeptBuffers(buffers=(LentBuffer(0, fd_bytes=1), LentBuffer(1, fd_bytes=1)), slots=(0, 1), drop=())
        here.send(frame, [r, w])
        got, fds = there.recv_fds(5.0)
        assert got == frame and len(fds) == 2
        os.write(fds[1], b"x")
        assert os.read(r, 1) == b"x"  # the descriptors are the pipe's ends
        for fd in fds:
            os.close(fd)
        _send_raw(here, {"v": PROTOCOL_VERSION, "kind": "offer", "direct": "maybe"})
        with pytest.raises(FrameError, match="field 'direct' must be true or false"):
            there.recv(5.0)
        here.send(Offer(direct=True))  # the channel is in step after a bad frame
        assert there.recv(5.0) == Offer(direct=True)
    finally:
        for fd in (r, w):
            os.close(fd)
        here.close()
        there.close()


@pytest.mark.unit
@pytest.mark.parametrize("sent,expected", [
    ({"v": PROTOCOL_VERSION, "kind": "hullo", "rank": 0}, "a bad frame from the engine: greeting from the engine: "
                                                          "bad control frame 'hullo': unknown kind 'hullo'"),
    ({"v": PROTOCOL_VERSION, "kind": "hello", "rank": 0, "client": "c", "have": [], "plan_known": "no"},
     "field 'plan_known' must be true or false, got a string"),
    (encode(Ready()), "expected a 'hello' frame (the engine sent 'ready')"),
    (encode(Error("no room for bucket 0", 0)), "the engine gave the update up at bucket 0: no room for bucket 0"),
])
def test_the_trainer_side_raises_an_update_error_naming_a_bad_frame(sent, expected):
    sink = IPCSink(ReferenceEngine("http://127.0.0.1:9"), timeout_s=5.0)
    engine_end, sink._channel = _pair()
    try:
        _send_raw(engine_end, sent)
        with pytest.raises(UpdateError) as caught:
            sink._receive(Hello, "connect", "greeting from the engine")
        assert caught.value.phase == "connect" and expected in caught.value.detail, caught.value.detail
        if sent["kind"] != "error":  # the engine is told why (an engine's own error frame is not answered)
            told = engine_end.recv(5.0)
            assert isinstance(told, Error) and expected.split(": ")[-1] in told.message, told
    finally:
        engine_end.close()
        sink.disconnect()


# -- a live engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[str, str]:
    cfg = preset_config("tiny-qwen3")
    root = tmp_path_factory.mktemp("frames")
    return save_random_checkpoint(cfg, root / "eng", seed=71), save_random_checkpoint(cfg, root / "src", seed=72)


def _fake_trainer(url: str, misbehave: Callable[[Channel], None]) -> tuple[Frame, str]:
    """An update ahead over IPC from a trainer that misbehaves on its control channel once it answered the offer
    (writing nowhere, as soon as the engine connected) and the engine greeted it: what the engine answers there,
    and what its request answered."""
    eng = ReferenceEngine(url, timeout_s=30)
    eng.begin_update("never")
    listener = Listener()
    try:
        request = eng.receive_ipc_ahead("plan-of-a-fake-trainer", 1, [listener.address], "a-fake-trainer", 10.0)
        chan = listener.accept(10.0)
        chan.send(OfferAnswer(direct=False, have=None, events=()))
        hello = chan.recv(10.0, "the greeting")
        assert isinstance(hello, Hello) and not hello.plan_known, hello
        misbehave(chan)
        answer = chan.recv(10.0, "the engine's answer")
        with pytest.raises(EngineError) as refused:
            request.result(30.0)
        chan.close()
    finally:
        listener.close()
        eng.abort_update()
    return answer, str(refused.value)


def _bad_bucket(chan: Channel) -> None:
    """A good plan, no direct writes (as answered), then bucket 0's frame with a field the protocol does not
    have."""
    chan.send(Plan((BucketLayout(("model.norm.weight",), ("float32",), ((64,),), (0,)),)))
    assert isinstance(chan.recv(10.0), Offer)
    _send_raw(chan, {**encode(BucketSent(k=0, buffer=LentBuffer(0), offset=0, nbytes=256, keep=True)), "rush": 1})


def test_a_live_engine_answers_a_malformed_frame_with_an_error_frame_and_goes_on_serving(dirs):
    eng_dir, src = dirs
    before = hf_logits(eng_dir, INPUT_IDS)
    cases = {
        "unknown kind": (lambda c: _send_raw(c, {"v": PROTOCOL_VERSION, "kind": "teleport"}),
                         None, "unknown kind 'teleport'"),
        "wrong type": (lambda c: _send_raw(c, {"v": PROTOCOL_VERSION, "kind": "plan", "buckets": "all of them"}),
                       None, "field 'buckets' must be a list, got a string"),
        "wrong version": (lambda c: _send_raw(c, {**encode(Plan(())), "v": PROTOCOL_VERSION + 1}),
                          None, f"protocol version {PROTOCOL_VERSION + 1}"),
        "another kind": (lambda c: c.send(WritesDone()), None, "expected a 'plan' frame"),
        "unknown field in a bucket": (_bad_bucket, 0, "unknown fields ['rush']"),
    }
    with engine(eng_dir) as server:
        eng = ReferenceEngine(server.url, timeout_s=30)
        for case, (misbehave, bucket, problem) in cases.items():
            answer, refused = _fake_trainer(server.url, misbehave)
            assert isinstance(answer, Error) and problem in answer.message, (case, answer)
            assert answer.bucket == bucket, (case, answer)
            assert problem in refused, (case, refused)  # the engine's request says so too
            assert not server.engine.session_open and server.engine.alive(), case
            assert_logits_close(eng.logits(INPUT_IDS), before)  # nothing of it was applied
        assert eng.weight_version() == "default"
        start = time.monotonic()
        (update,) = launch(1, run_update, Case(src, Layout(1, 1)), [server.url],
                           [{"transport": "ipc", "bucket_bytes": SMALL}])[0]
        assert "error" not in update, update
        assert update["report"].metadata_ahead, update
        after = eng.logits(INPUT_IDS)
    assert_logits_close(after, hf_logits(src, INPUT_IDS))
    print(f"a good update after {len(cases)} refused frames: {time.monotonic() - start:.1f} s")
