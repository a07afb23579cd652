"""weightstream's custom weight loader inside SGLang (``weightstream.integrations.sglang_loader``).

In this process: the header's one decode listing every problem, and :func:`load_bucket` taking sessions, plain
and delta buckets into a real torch model while reporting each rank's outcome to the trainer's TCP store (a
corrupted bucket reported, never raised). Against SGLang's own code: tests/engines/sglang_loader_check.py
(run by ``WEIGHTSTREAM_SGLANG_PYTHON``; skipped without it, failed instead when ``WEIGHTSTREAM_REQUIRE_SGLANG=1``)
drives an :class:`SGLangEngine` made with ``custom_loader`` through SGLang's request decoding, deserializer,
``ServerArgs`` and ``WeightUpdater.update_weights_from_tensor`` in one process per TP rank, by hand and by
``WeightSync(transport="ipc", delta=True)`` from two colocated trainer ranks.
"""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path

import pytest
import torch

from tests.helpers.checks import engine_check
from weightstream import WeightSync
from weightstream.engines.base import (
    BROADCAST,
    DELTA,
    IPC,
    IPC_AHEAD,
    IPC_DELTA,
    DeltaChecks,
    DeltaEngine,
    EngineError,
    EngineInfo,
    implementing,
)
from weightstream.engines.sglang import SGLangEngine
from weightstream.engines.sglang_inside import (
    LOADER,
    PREFIX,
    HeaderError,
    LoaderClient,
    LoaderHeader,
    RankDelta,
    RankOutcome,
    ReplyChannel,
    decode_header,
    engine_delta,
    failures,
    loader_problems,
)
from weightstream.errors import UpdateError
from weightstream.integrations import sglang_loader
from weightstream.models.presets import preset_config, random_hf_model
from weightstream.sinks.delta import DELTA_TRANSPORTS, DeltaTracker, takes_deltas, transport_problem
from weightstream.streaming.bucket import Bucket
from weightstream.streaming.delta import Snapshot, encode
from weightstream.wire.handles import checksum

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "engines" / "sglang_loader_check.py"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


class Model(torch.nn.Module):
    """Mixed dtypes; ``load_weights`` as SGLang's models take HF-named tensors."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(5), requires_grad=False)
        self.c = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.int8), requires_grad=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randint(0, 256, (p.numel() * p.element_size(),), generator=g, dtype=torch.uint8)
             .view(p.dtype).view(p.shape)) for n, p in Model().named_parameters()]


@pytest.fixture(autouse=True)
def fresh_receiver(monkeypatch):
    """This process's receiver as a fresh scheduler has it (a new instance, nothing held)."""
    monkeypatch.setattr(sglang_loader, "_RECEIVER", sglang_loader.Receiver())


@pytest.fixture
def channel():
    ch = ReplyChannel(timeout_s=5.0)
    model = Model()
    sglang_loader.load_bucket(model, [(ch.open_headers(1)[0].encode(), torch.empty(0, dtype=torch.uint8))])
    assert ch.outcomes("open", 1)[0].ok
    return ch, model


def _load(ch, model, bucket: Bucket, buffer: torch.Tensor | None = None, op_id: str = "op"):
    header = LoaderHeader("load", op_id=op_id, index=bucket.index, metas=bucket.metas, nbytes=bucket.nbytes,
                          checksum=checksum(bucket.buffer), delta=bucket.delta)
    sglang_loader.load_bucket(model, [(header.encode(), bucket.buffer if buffer is None else buffer)])
    return ch.outcomes(str(bucket.index), 1)[0]


@pytest.mark.unit
def test_header_round_trip():
    b = Bucket.pack(_weights(1), index=4)
    h = LoaderHeader("load", op_id="x", index=4, metas=b.metas, nbytes=b.nbytes, checksum=checksum(b.buffer))
    assert decode_header(h.encode()) == h
    assert h.encode().startswith(PREFIX)


@pytest.mark.unit
def test_header_problems_listed_together():
    bad = PREFIX + json.dumps({"op": "load", "op_id": "", "index": 2, "names": ["a", "b"], "dtypes": ["float99"],
                               "shapes": [[2]], "offsets": [0], "nbytes": -1, "checksum": 7, "delta": None})
    with pytest.raises(HeaderError) as info:
        decode_header(bad)
    assert info.value.index == 2
    assert list(info.value.problems) == [
        "op_id must be a non-empty string", "names, dtypes, shapes differ in length (2, 1, 1)",
        "unknown dtypes ['float99']", "offsets must be one non-negative integer per tensor",
        "nbytes must be a non-negative integer", "checksum must be a string or null"]
    with pytest.raises(HeaderError, match="header version '2' is not this loader's"):
        decode_header("weightstream/2:{}")
    with pytest.raises(HeaderError, match="lie outside the bucket's 8"):
        decode_header(PREFIX + json.dumps({"op": "load", "op_id": "x", "index": 0, "names": ["a"],
                                           "dtypes": ["float32"], "shapes": [[3]], "offsets": [0], "nbytes": 8,
                                           "checksum": None, "delta": None}))


@pytest.mark.unit
def test_plain_bucket_loads_bit_for_bit_and_reports(channel):
    ch, model = channel
    want = _weights(1)
    b = Bucket.pack(want, index=0)
    got = _load(ch, model, b)
    assert (got.ok, got.error, got.loaded, got.nbytes, got.digest) == (True, None, 3, b.nbytes, checksum(b.buffer))
    assert all(_same_bits(dict(model.named_parameters())[n], t) for n, t in want)


@pytest.mark.unit
def test_corrupted_bucket_reported_not_raised(channel):
    ch, model = channel
    b = Bucket.pack(_weights(2), index=1)
    wrong = b.buffer.clone()
    wrong[0] ^= 1
    got = _load(ch, model, b, wrong)  # returns: SGLang's scheduler goes on
    assert not got.ok and "bucket 1 arrived corrupted" in got.error and "nothing of it was loaded" in got.error
    assert all(int(p.view(-1).view(torch.uint8).abs().sum()) == 0 for p in model.parameters())
    assert failures(ch_outcomes := [got]) == f"1 of 1 TP ranks failed: rank 0: {ch_outcomes[0].error}"


@pytest.mark.unit
def test_delta_rounds_and_second_runner(channel):
    ch, model = channel
    w1, w2 = _weights(3), _weights(3)
    w2[0][1].view(-1)[:3] = torch.tensor([1.5, -2.0, float("nan")], dtype=torch.bfloat16)
    full1, full2 = Bucket.pack(w1, index=5), Bucket.pack(w2, index=5)
    header, payload = encode(full1.buffer, torch.zeros_like(full1.buffer), full1.word, ("dense",))
    assert _load(ch, model, Bucket(5, payload, full1.metas, delta=header)).ok
    header, payload = encode(full2.buffer, full1.buffer, full2.word)
    assert header.encoding != "dense"
    delta = Bucket(5, payload, full2.metas, delta=header)
    got = _load(ch, model, delta, op_id="d")
    assert (got.ok, got.digest) == (True, checksum(full2.buffer))
    draft = Model()  # SGLang's second runner, same payload: loads what was received, applies nothing again
    assert _load(ch, draft, delta, op_id="d").ok
    for m in (model, draft):
        assert all(_same_bits(dict(m.named_parameters())[n], t) for n, t in w2)


@pytest.mark.unit
def test_delta_without_held_bytes_reported(channel):
    ch, model = channel
    full = Bucket.pack(_weights(4), index=9)
    changed = full.buffer.clone()
    changed[:2] ^= 0x11
    header, payload = encode(changed, full.buffer, full.word)
    assert header.encoding == "indices"
    got = _load(ch, model, Bucket(9, payload, full.metas, delta=header))
    assert not got.ok and "holds no bytes of that bucket" in got.error
    assert all(int(p.view(-1).view(torch.uint8).abs().sum()) == 0 for p in model.parameters())


@pytest.mark.unit
def test_server_without_the_loader_refused():
    assert loader_problems({"custom_weight_loader": [LOADER], "tp_size": 2}, LOADER) == []
    problems = loader_problems({"custom_weight_loader": None, "dp_size": 2}, LOADER)
    assert problems == [
        f"the server was not started with --custom-weight-loader {LOADER} (it lists []): SGLang would refuse "
        "the request by ending its scheduler",
        "dp_size 2: the custom loader reports per TP rank (run it at 1)"]
    with pytest.raises(ValueError, match="weightstream's SGLang loader is"):
        LoaderClient("os.system", 5.0)


class _InProcess(SGLangEngine):
    """An SGLangEngine at TP 1 whose ``/update_weights_from_tensor`` runs the loader in this process, as SGLang's
    runner would with the payload unpickled (the rest of SGLang: tests/engines/sglang_loader_check.py), and only
    between ``/begin_weight_update`` and ``/end_weight_update``, as SGLang takes tensor updates."""

    def __init__(self, model, **kw):
        super().__init__("http://sglang.in-process", custom_loader=LOADER, timeout_s=5.0, **kw)
        self.model, self.paths, self.in_session = model, [], False

    def request(self, method, path, body=None, *, step=None, timeout_s=None):
        self.paths.append(path)
        if path == "/get_server_info":
            return {"tp_size": 1, "custom_weight_loader": [LOADER]}
        if path in ("/begin_weight_update", "/end_weight_update"):
            self.in_session = path == "/begin_weight_update"
        if path == "/update_weights_from_tensor":
            if not self.in_session:
                raise EngineError(self.url, step, "must run between begin_weight_update() and end_weight_update()")
            assert body["load_format"] == LOADER
            sglang_loader.load_bucket(self.model, pickle.loads(base64.b64decode(body["serialized_named_tensors"][0])))
        return {"weight_version": self._version} if path == "/model_info" else {}


@pytest.mark.unit
def test_adapter_sends_through_the_loader_and_raises_for_failed_ranks():
    model = Model()
    engine = _InProcess(model)
    want = _weights(7)
    bucket = Bucket.pack(want, index=0)
    engine.begin_update("v1")
    engine.receive_ipc(0, [engine.encode_ipc(bucket)], None)
    assert engine.commit_update() == "v1"
    assert all(_same_bits(dict(model.named_parameters())[n], t) for n, t in want)
    engine.begin_update("v2")
    other = Bucket.pack(_weights(8), index=1)
    payload = engine.encode_ipc(other)
    other.buffer[3] ^= 0x40  # after its checksum was taken
    with pytest.raises(EngineError, match=r"1 of 1 TP ranks failed: rank 0: ChecksumError: bucket 1 arrived "
                                          r"corrupted") as info:
        engine.receive_ipc(1, [payload], None)
    assert info.value.step == "update_weights_from_tensor (bucket 1, custom weight loader)"
    assert all(_same_bits(dict(model.named_parameters())[n], t) for n, t in want)  # nothing of bucket 1 loaded


@pytest.mark.unit
def test_state_and_commit_headers_round_trip_and_problems():
    ch = ReplyChannel(timeout_s=5.0)
    for op, version in (("state", None), ("commit", "v7")):
        h = ch.query_headers(op, "q1", 2, version)[1]
        assert (decode_header(h.encode()), h.tp_rank, h.version) == (h, 1, version)
    bad = json.loads(ch.query_headers("commit", "q1", 1, "v")[0].encode()[len(PREFIX):])
    bad.update(version="", session="", tp_rank=3)
    with pytest.raises(HeaderError) as info:
        decode_header(PREFIX + json.dumps(bad))
    assert list(info.value.problems) == [
        "session must be a non-empty string", "a commit's version must be non-empty printable text",
        "tp_rank and tp_size must be integers, 0 <= tp_rank < tp_size"]
    state = RankOutcome(1, True, delta=RankDelta("i1", None, ((0, "a"), (4, "b"))))
    assert RankOutcome.from_json(1, state.as_json().encode()) == state
    assert engine_delta([RankDelta("i1", "v", ((0, "a"),)), RankDelta("i2", "v", ((0, "b"), (1, "c")))]) == \
        DeltaChecks("i1+i2", "i1+i2/v", {0: ("a", "b"), 1: ("", "c")})
    assert engine_delta([RankDelta("i1", "v"), RankDelta("i2", None)]).base is None


def _weights_of(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _round(engine, snapshot: Snapshot, version: str, weights, full: bool) -> str | None:
    """One delta-mode update of two buckets through the adapter, as the IPC sink sends it per bucket: the base
    the engine holds asked in the open session (as the trainer asks before the stream), each bucket encoded by the
    trainer's snapshot, the engine's checks compared before the commit. The base it held."""
    engine.begin_update(version)
    base = implementing(engine, IPC_DELTA, DeltaEngine).delta_base()
    snapshot.begin(full=full, active=True)
    for index, part in enumerate((weights[:1], weights[1:])):
        bucket = Bucket.pack(part, index=index)
        header, payload = snapshot.encode(index, bucket.buffer, bucket.word)
        assert (header.encoding == "dense") == full
        engine.receive_ipc(index, [engine.encode_ipc(Bucket(index, payload, bucket.metas, delta=header))], None)
    checks = implementing(engine, IPC_DELTA, DeltaEngine).delta_checks()
    assert checks.buckets == {i: (d,) for i, d in snapshot.digests.items()}
    assert engine.commit_update() == version
    return base


@pytest.mark.unit
def test_full_then_delta_rounds_bit_for_bit_with_the_engines_checksums():
    model = Model()
    engine = _InProcess(model)
    # deltas by IPC, one request per bucket; not by broadcast, which reaches SGLang's own distributed path
    assert (engine.info().can(IPC_DELTA), engine.info().can(DELTA)) == (True, False)
    assert not SGLangEngine("http://sglang.plain").capabilities({"tp_size": 1}) & {IPC_DELTA, DELTA}
    snapshot, weights = Snapshot(), _weights(11)
    assert _round(engine, snapshot, "v1", weights, full=True) is None  # holds nothing yet: the first is full
    instance = sglang_loader.receiver().instance
    for before, version, changed in (("v1", "v2", [1.5, -2.0, float("nan")]), ("v2", "v3", [0.25, 7.0, -0.0])):
        weights = [(n, t.clone()) for n, t in weights]
        weights[0][1].view(-1)[:3] = torch.tensor(changed, dtype=torch.bfloat16)
        weights[2][1].view(-1)[4] += 1
        assert _round(engine, snapshot, version, weights, full=False) == f"{instance}/{before}"
        assert all(_same_bits(got, want) for (_, got), (_, want) in zip(_weights_of(model), weights, strict=True))
    assert [p for p in engine.paths if p != "/get_server_info"].count("/end_weight_update") == 3


@pytest.mark.unit
def test_restarted_engine_names_no_base_and_refuses_a_delta(monkeypatch):
    model = Model()
    engine = _InProcess(model)
    snapshot, weights = Snapshot(), _weights(12)
    _round(engine, snapshot, "v1", weights, full=True)
    before = f"{sglang_loader.receiver().instance}/v1"
    assert _round(engine, snapshot, "v2", weights, full=False) == before  # what the trainer committed: deltas
    monkeypatch.setattr(sglang_loader, "_RECEIVER", sglang_loader.Receiver())  # the server restarted
    engine.begin_update("v3")
    assert engine.delta_base() is None  # not what the trainer committed: its next update is full
    weights[0][1].view(-1)[0] += 1
    bucket = Bucket.pack(weights[:1], index=0)
    snapshot.begin(full=False, active=True)
    header, payload = snapshot.encode(0, bucket.buffer, bucket.word)
    with pytest.raises(EngineError, match="holds no bytes of that bucket"):
        engine.receive_ipc(0, [engine.encode_ipc(Bucket(0, payload, bucket.metas, delta=header))], None)
    engine.abort_update()
    snapshot.forget()
    assert _round(engine, snapshot, "v3", weights, full=True) is None  # the full update that follows
    after = f"{sglang_loader.receiver().instance}/v3"
    assert _round(engine, snapshot, "v4", weights, full=False) == after != f"{before[:-3]}/v3"
    assert all(_same_bits(got, want) for (_, got), (_, want) in zip(_weights_of(model), weights, strict=True))


@pytest.mark.unit
def test_plain_or_aborted_session_leaves_no_base():
    model = Model()
    engine = _InProcess(model)
    snapshot, weights = Snapshot(), _weights(13)
    _round(engine, snapshot, "v1", weights, full=True)
    engine.begin_update("v2")  # an update that is not delta-mode: its buckets go whole
    engine.receive_ipc(0, [engine.encode_ipc(Bucket.pack(weights, index=0))], None)
    assert engine.delta_base() is None
    assert engine.commit_update() == "v2"
    snapshot.forget()
    assert _round(engine, snapshot, "v3", weights, full=True) is None
    engine.begin_update("v4")  # a delta session that is aborted: its bytes are no committed version's
    assert engine.delta_base() == f"{sglang_loader.receiver().instance}/v3"
    weights[0][1].view(-1)[0] += 1
    bucket = Bucket.pack(weights[:1], index=0)
    snapshot.begin(full=False, active=True)
    header, payload = snapshot.encode(0, bucket.buffer, bucket.word)
    engine.receive_ipc(0, [engine.encode_ipc(Bucket(0, payload, bucket.metas, delta=header))], None)
    engine.abort_update()
    engine.begin_update("v5")
    assert engine.delta_base() is None


class Served(torch.nn.Module):
    """An engine's copy of a transformers model: ``load_weights`` puts HF-named tensors into it, as SGLang's do."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.inner = model

    def load_weights(self, weights):
        held = self.inner.state_dict()
        for name, tensor in weights:
            held[name].copy_(tensor)


def _step(model: torch.nn.Module, seed: int, every: int) -> None:
    """A training step's change: every ``every``-th word of each tensor moves (every=1: all of them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            flat[::every] += torch.randn(flat[::every].shape, generator=g).to(p.dtype)


def _holds(served: Served, trainer: torch.nn.Module) -> bool:
    ours = trainer.state_dict()
    return sorted(served.inner.state_dict()) == sorted(ours) and all(
        _same_bits(t, ours[n]) for n, t in served.inner.state_dict().items())


def test_weightsync_delta_updates_by_ipc_one_request_per_bucket():
    """WeightSync(delta=True) over IPC into SGLang with the loader (in this process): full, then deltas (dense,
    sparse, and none changed: every payload empty) each bucket one request, the engine's weights the trainer's bit
    for bit, every update checked."""
    config = preset_config("tiny-qwen3")
    trainer = random_hf_model(config, seed=1, dtype=torch.bfloat16)
    served = Served(random_hf_model(config, seed=2, dtype=torch.bfloat16))
    engine = _InProcess(served)
    with WeightSync([engine], transport="ipc", bucket_bytes=120_000, delta=True) as sync:
        for step, every in enumerate((1, 1, 97, 0)):
            if every:
                _step(trainer, step, every)
            report = sync.update(trainer, config, weight_version=f"v{step}")
            d = report.delta
            assert (report.transport, report.metadata_ahead, d.full, d.encoded, d.checked) == (
                "ipc", False, step == 0, True, True), d.summary()
            assert _holds(served, trainer)
            if step == 1:
                assert set(d.encodings) == {"dense"} and report.buckets > 1
            if step > 1:
                assert "dense" not in d.encodings and d.wire_bytes < report.bytes // 10, d.summary()
        assert (d.changed, d.wire_bytes) == (0, 0)  # the last: no word changed
        posts = [p for p in engine.paths if p == "/update_weights_from_tensor"]
        # per update: open, each bucket, state (what it applied), commit; and the base asked before each delta
        assert len(posts) == 4 * (report.buckets + 3) + 3


@pytest.mark.unit
def test_which_engines_take_deltas_by_which_transport():
    declared = {"reference": {BROADCAST, IPC, IPC_AHEAD, DELTA}, "vllm": {BROADCAST, DELTA},
                "sglang with the loader": {BROADCAST, IPC, IPC_DELTA}, "sglang": {BROADCAST, IPC}}
    ways = {name: [t for t in DELTA_TRANSPORTS if takes_deltas(EngineInfo(name, capabilities=frozenset(caps)), t)]
            for name, caps in declared.items()}
    assert ways == {"reference": ["broadcast", "p2p", "ipc"], "vllm": ["broadcast", "p2p"],
                    "sglang with the loader": ["ipc"], "sglang": []}
    engine = _InProcess(Model())
    assert transport_problem([engine], "ipc") is None
    problem = transport_problem([engine], "p2p")
    assert problem is not None and problem.startswith(
        "a delta-mode update by p2p into engines ['http://sglang.in-process']: they apply deltas by IPC only")
    with pytest.raises(ValueError) as caught:  # the tracker refuses it too, before it asks the engine anything
        DeltaTracker(Snapshot()).begin([engine], "p2p", "plan")
    assert str(caught.value) == problem
    assert engine.paths == ["/get_server_info"]


@pytest.mark.unit
def test_a_delta_by_broadcast_into_sglang_refused_before_anything_is_sent():
    config = preset_config("tiny-qwen3")
    engine = _InProcess(Served(random_hf_model(config, seed=2, dtype=torch.bfloat16)))
    with WeightSync([engine], transport="broadcast", delta=True) as sync:
        with pytest.raises(UpdateError) as caught:
            sync.update(random_hf_model(config, seed=1, dtype=torch.bfloat16), config, weight_version="v1")
    assert caught.value.phase == "connect"
    assert ("a delta-mode update by broadcast into engines ['http://sglang.in-process']: they apply deltas by IPC "
            "only, one request per bucket (they declare 'ipc_delta', not 'delta'), and what they receive by "
            "broadcast goes to the engine's own receiver, which takes whole buckets; update them by "
            "transport='ipc' (colocated), or without delta") in str(caught.value)
    assert not {"/pause_generation", "/begin_weight_update", "/init_weights_update_group",
                "/update_weights_from_tensor", "/update_weights_from_distributed"} & set(engine.paths)


# -- against SGLang's own code --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def result() -> dict:
    return engine_check("sglang", "sglang, transformers", CHECK, ROOT)


def test_sglang_parses_the_flag_and_decodes_the_requests(result):
    assert result["server_args"]["parsed"] == [LOADER]
    assert result["load_formats"] == [LOADER, "weightstream.integrations.sglang_loader.other"]
    assert result["unknown_fields"] == []
    assert result["raised_outside_unlisted"] == []  # nothing reached SGLang as an exception
    assert result["sglang_answers"] == [[True, "Success"]]


def test_rounds_load_bit_for_bit(result):
    assert result["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float8_e4m3fn", "torch.int8"]
    for key in ("plain", "dense", "sparse"):
        assert result[f"{key}_error"] is None, result[f"{key}_error"]
        assert result[f"{key}_equal"] == {f"{r}/{m}": True for r in range(2) for m in ("target", "draft")}
    assert set(result["sparse_encodings"]) <= {"indices", "bitmap"}


def test_delta_state_and_commit_through_sglang(result):
    assert (result["dense_base"], result["dense_checks"], result["sparse_checks"]) == (None, True, True)
    instances, version = result["sparse_base"].split("/")
    assert (len(instances.split("+")), version) == (2, "v2")  # each TP rank's instance, the version committed


EVERY_RANK = {f"{r}/{m}": True for r in range(2) for m in ("target", "draft")}


def test_weightsync_delta_updates_through_sglang(result):
    """Two colocated trainer ranks' WeightSync(delta=True) into the TP 2 ranks: a full update, a dense delta and a
    sparse one, each bucket one request per rank pair, every TP rank's target and draft the trainer's bit for bit,
    every update checked against the ranks' checksums; SGLang's code raised nothing and answered every request."""
    rounds = result["sync"]
    for version, r in rounds.items():
        assert (r["error"], r["transport"], r["ahead"], r["encoded"], r["checked"], r["equal"]) == (
            None, "ipc", False, True, True, EVERY_RANK), (version, r)
    assert [(r["full"], r["reason"]) for r in rounds.values()] == [
        (True, "the first update"), (False, "deltas against version s1"), (False, "deltas against version s2")]
    assert (rounds["s1"]["encodings"], rounds["s2"]["encodings"]) == (["dense"], ["dense"])
    assert rounds["s3"]["encodings"] and set(rounds["s3"]["encodings"]) <= {"indices", "bitmap"}
    assert rounds["s3"]["wire_bytes"] < rounds["s3"]["bytes"] // 10 and rounds["s1"]["buckets"] > 1
    assert (result["sync_raised"], result["sync_sglang_answers"], result["sync_unknown_fields"]) == (
        [], [[True, "Success"]], [])
    assert result["trainer1"]["returncode"] == 0, result["trainer1"]["log"]


def test_weightsync_delta_against_a_base_the_ranks_do_not_hold(result):
    """Another trainer committed this one's last version name. Buckets of another plan: every rank refuses the
    delta, named in one error, nothing of it loaded; the next update is full. Buckets of the same plan: the check
    finds every bucket's checksums wrong and the update goes again in full. Either way the ranks end bit for bit
    with this trainer's weights."""
    other, same = result["other_plan"], result["same_plan"]
    assert (other["error"], other["equal"], same["error"], same["equal"]) == (None, EVERY_RANK, None, EVERY_RANK)
    refusal = "delta bucket 0: this engine holds no bytes of that bucket to apply it to (a full update must come first)"
    assert other["next"]["error"] == (
        "weight update failed at bucket 0 (engine http://sglang.check): engine http://sglang.check: "
        "update_weights_from_tensor (bucket 0, custom weight loader) failed: 2 of 2 TP ranks failed: "
        f"rank 0: ValueError: {refusal}; rank 1: ValueError: {refusal}")
    after = other["after"]
    assert (after["error"], after["full"], after["checked"], after["reason"], after["equal"]) == (
        None, True, True, "the last update failed (UpdateError)", EVERY_RANK)
    wrong = ("engine http://sglang.check: the bytes it applied of buckets [0, 1, 2, 3, 4, 5, 6] differ from the "
             "trainer's (checksums)")
    again = same["next"]
    assert (again["error"], again["mismatch"], again["full"], again["checked"], again["equal"]) == (
        None, wrong, True, True, EVERY_RANK)


def test_failures_reported_by_rank(result):
    err = result["corrupt_error"]
    assert "1 of 2 TP ranks failed: rank 1: ChecksumError: bucket 0 arrived corrupted" in err, err
    assert result["corrupt_rank0_loaded"] == {"0/target": True, "0/draft": True}
    assert result["corrupt_rank1_unchanged"] == {"1/target": True, "1/draft": True}
    assert "2 of 2 TP ranks failed" in result["unheld_error"] and "holds no bytes" in result["unheld_error"]
    assert result["unheld_unchanged"] and result["ranks_alive"]
    err = result["malformed_error"]
    assert "2 of 2 TP ranks failed" in err and "names, dtypes, shapes differ in length (2, 1, 1)" in err
    assert "unknown dtypes ['float99']" in err


def test_unlisted_loader_refused(result):
    assert result["unlisted_raised"] == [
        "NotImplementedError: Unknown load_format=weightstream.integrations.sglang_loader.other"] * 2
    assert "was not started with --custom-weight-loader" in result["no_flag_error"]
    assert result["no_flag_sent"] == ["/get_server_info"]  # refused before the session is opened
