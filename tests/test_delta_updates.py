"""Delta updates end to end on the CPU: a transformers Qwen3 trainer (Adam on fp32 master weights, copied to bf16
after each step) updates a real reference engine (its own worker process, HTTP, a gloo broadcast group) with
``WeightSync(delta=True)``. After every update the engine holds the trainer's bf16 tensors bit for bit; an
engine restart forces a full update, saying why; a corrupted delta is caught by the check, and the update is
sent again in full. A Megatron-Core trainer at TP 2 (its gathered buckets sent by rank 0) does the same."""

from __future__ import annotations

import contextlib
from contextlib import contextmanager

import pytest
import torch

from tests.helpers.delta_workers import HFAdamTrainer, run_delta_updates
from tests.helpers.faults import HeldWeights, hide_capabilities, serve_with_fault
from tests.helpers.workers import Case
from weightstream import WeightSync
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.reference_engine.protocol import DeltaChecksums
from weightstream.reference_engine.server import stop

SMALL = 120_000  # bytes per bucket: the tiny model travels in several buckets
LR = 1e-5


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    """What the engine starts from: other random weights of the same config."""
    return save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path_factory.mktemp("delta") / "m", seed=123)


@contextmanager
def engine(model_dir: str, fault: str = "none", port: int = 0, tp: int = 1, ahead: bool | None = None):
    """A reference engine holding bf16 weights (so that they compare bit for bit with the trainer's); without a
    fault (or with ``ahead``) it declares all it can (``broadcast_ahead``, ``p2p_ahead`` and ``delta_ahead`` too: a
    delta-mode update then sends every bucket's metadata ahead, and each delta's header on the wire)."""
    server = serve_with_fault(model_dir, tp, fault, dtype="bfloat16", port=port)
    if fault == "none" if ahead is None else ahead:
        server.routes[("GET", "/get_server_info")] = server.server_info
    try:
        yield server
    finally:
        stop(server)


class Trainer(HFAdamTrainer):
    """Adam on fp32 master weights of a preset's transformers model, at :data:`LR`."""

    def __init__(self, seed: int = 0, preset: str = "tiny-qwen3"):
        super().__init__(preset_config(preset), seed, LR)


def _whole(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A tensor from what each engine rank holds of it: its shards joined along the dim they split, or (held
    whole on every rank) rank 0's, where every rank holds the same bits."""
    if parts[0].shape == like.shape:
        assert all(torch.equal(p.view(torch.int16), parts[0].view(torch.int16)) for p in parts)
        return parts[0]
    dim = next(i for i, (a, b) in enumerate(zip(parts[0].shape, like.shape, strict=True)) if a != b)
    return torch.cat(parts, dim)


def assert_engine_holds(server, trainer: Trainer) -> None:
    assert_held(server.engine.call(HeldWeights()), trainer.tensors())


def assert_held(ranks: list[dict[str, torch.Tensor]], ours: dict[str, torch.Tensor]) -> None:
    """What each engine rank holds (``held_weights``), joined, equals ``ours`` bit for bit."""
    assert sorted(ranks[0]) == sorted(ours)
    different = [n for n, t in ours.items()
                 if not torch.equal(_whole([r[n] for r in ranks], t).view(torch.int16), t.view(torch.int16))]
    assert not different, f"the engine's tensors differ from the trainer's: {different}"


def _update(sync: WeightSync, trainer: Trainer, version: str):
    report = sync.update(trainer.model, trainer.config, weight_version=version)
    assert report.transport == "broadcast" and report.weight_version == version
    return report


def test_twenty_delta_updates_bit_exact(engine_dir):
    trainer = Trainer()
    with engine(engine_dir) as server, WeightSync([server.url], bucket_bytes=SMALL, delta=True) as sync:
        first = _update(sync, trainer, "v0")
        assert (first.delta.full, first.delta.reason, first.delta.checked) == (True, "the first update", True)
        assert first.delta.wire_bytes == first.bytes and first.delta.snapshot_bytes == first.bytes
        assert first.delta.encodings == {"dense": first.buckets}
        assert_engine_holds(server, trainer)
        sent = dense = 0
        for step in range(1, 20):
            trainer.step()
            report = _update(sync, trainer, f"v{step}")
            d = report.delta
            assert not d.full and d.checked and d.mismatch is None, report.summary()
            assert report.metadata_ahead  # every bucket's metadata in one request, each header on the wire
            assert d.reason == f"deltas against version v{step - 1}"
            assert sum(d.encodings.values()) == report.buckets and d.words * 2 == report.bytes
            assert 0 < d.changed < d.words
            sent, dense = sent + d.wire_bytes, dense + report.bytes
            assert_engine_holds(server, trainer)
        assert server.engine.delta_base == f"{server.engine.instance}/v19"
    assert sent < dense / 3  # Adam at 1e-5 on bf16: a small fraction of the words change each step


def test_full_every_and_restart_force_full_updates(engine_dir):
    trainer = Trainer(seed=1)
    with engine(engine_dir) as server:
        port = server.server_address[1]
        # checksums=True: each payload is checked as it arrives too
        sync = WeightSync([server.url], bucket_bytes=SMALL, delta=True, full_every=3, checksums=True)
        reasons = []
        for step in range(4):
            trainer.step()
            reasons.append(_update(sync, trainer, f"v{step}").delta.reason)
        assert reasons == ["the first update", "deltas against version v0", "deltas against version v1",
                           "every 3-th update is full (full_every=3)"]
        assert_engine_holds(server, trainer)
        instance = server.engine.instance
        sync.close()
    with engine(engine_dir, port=port) as server:  # the engine restarts at the same address
        trainer.step()
        report = _update(sync, trainer, "v4")
        assert server.engine.instance != instance
        assert report.delta.full and report.delta.checked
        assert report.delta.reason == (f"engine {server.url} holds nothing to apply deltas to, not what this trainer "
                                       f"committed ({instance}/v3): restarted, rolled back or updated elsewhere")
        assert_engine_holds(server, trainer)
        trainer.step()
        assert not _update(sync, trainer, "v5").delta.full
        assert_engine_holds(server, trainer)
        sync.close()


def test_an_engine_that_takes_metadata_ahead_but_not_deltas_so_gets_each_bucket_with_its_header(engine_dir):
    """An engine that declares ``broadcast_ahead`` but not ``delta_ahead``: a delta-mode update's buckets (the first,
    full, and a delta) each go with their metadata and header (one request per bucket); both checked, the engine's
    tensors the trainer's bit for bit."""
    trainer = Trainer(seed=3)
    with engine(engine_dir) as server, WeightSync([server.url], bucket_bytes=SMALL, delta=True) as sync:
        hide_capabilities(server, ("delta_ahead",))
        reports = [_update(sync, trainer, "v1")]
        trainer.step()
        reports.append(_update(sync, trainer, "v2"))
        assert [(r.metadata_ahead, r.delta.full, r.delta.checked) for r in reports] == [(False, True, True),
                                                                                         (False, False, True)]
        assert_engine_holds(server, trainer)


@pytest.mark.parametrize("ahead", [False, True])
def test_corrupted_delta_caught_then_full_update(engine_dir, ahead):
    """A delta payload corrupted as it arrives, with each bucket's metadata sent per bucket or ahead (the header on
    the wire): the check catches it, and the update goes again in full."""
    trainer = Trainer(seed=2)
    with engine(engine_dir, fault="corrupt_delta@1", ahead=ahead) as server, \
            WeightSync([server.url], bucket_bytes=SMALL, delta=True) as sync:
        _update(sync, trainer, "v0")
        trainer.step()
        report = _update(sync, trainer, "v1")
        assert report.metadata_ahead == ahead
        d = report.delta
        assert d.mismatch == (f"engine {server.url}: the bytes it applied of buckets [1] differ from the trainer's "
                              "(checksums)")
        assert d.full and d.checked, report.summary()
        assert d.reason == f"the check of the last attempt found: {d.mismatch}"
        assert server.engine.weight_version == "v1"
        assert_engine_holds(server, trainer)
        trainer.step()
        after = _update(sync, trainer, "v2").delta
        assert not after.full and after.checked and after.mismatch is None
        assert_engine_holds(server, trainer)


@pytest.mark.parametrize("trainer_tp,engine_tp,transport,resharded", [
    (2, 1, "broadcast", False), (2, 2, "auto", True), (2, 1, "auto", True), (1, 2, "auto", True)])
def test_megatron_trainer_delta_updates(sources, engine_dir, trainer_tp, engine_tp, transport, resharded):
    """A Megatron-Core trainer (bf16 weights, Adam on fp32 masters). By broadcast (TP 2 into an engine at TP 1):
    gathered buckets from trainer rank 0, which alone keeps the snapshot and encodes. By P2P into an engine at the
    trainer's TP (resharded, as the engine declares its layout, but each trainer rank's bucket goes whole to its
    engine rank): each trainer TP rank encodes its own shards against its own snapshot, engine rank r checked
    against trainer rank r. Resharded P2P (TP 2 into TP 1, TP 1 into TP 2): each trainer rank encodes the bytes
    of each engine rank's rows against its snapshot of those, and each engine rank is checked against the
    routes that reached it. Every bucket's metadata (or routes) goes ahead in one request, and each delta's header
    on the wire before its payload."""
    case = Case(sources["tiny-qwen3"], Layout(trainer_tp), dtype="bfloat16", bucket_bytes=SMALL)
    with engine(engine_dir, tp=engine_tp) as server:
        results = launch(trainer_tp, run_delta_updates, case, server.url, 6, LR, transport)
        held = server.engine.call(HeldWeights())
    reports = results[0]["reports"]
    assert {r.transport for r in reports} == {"broadcast" if transport == "broadcast" else "p2p"}
    assert all(("resharded P2P" in r.reason) == resharded for r in reports), reports[0].reason
    assert [(r.delta.full, r.delta.checked) for r in reports] == [(True, True)] + [(False, True)] * 5
    assert all(r.metadata_ahead for r in reports)  # every bucket's routes in one request, each header on the wire
    # rank 0's share: the whole model gathered (broadcast), its own shards (P2P)
    assert all(0 < r.delta.wire_bytes < r.bytes / 2 for r in reports[1:]), [r.summary() for r in reports]
    # rank 0 decides and checks; every rank reports what it found
    assert all([r.delta for r in res["reports"]] == [r.delta for r in reports] for res in results[1:])
    assert_held(held, results[0]["tensors"])


@pytest.mark.parametrize("engines,tp", [(2, 1), (3, 1), (2, 2)])
def test_several_engines_by_p2p_delta_updates(sources, engine_dir, engines, tp):
    """A Megatron-Core trainer of two data-parallel replicas (TP 1) into several engines at its TP by P2P: engine
    j's buckets come from replica j % 2 (with 3 engines, replica 0 sends each bucket to two), each replica's rank
    encoding against its own snapshot (at TP 2, one replica: each TP rank its own shards, into two engines at TP
    2); every engine checked against the replica that sent to it, every update, and each holds the trainer's
    tensors bit for bit. Every bucket's metadata goes ahead, each delta's header on the wire before its payload."""
    case = Case(sources["tiny-qwen3"], Layout(tp), dtype="bfloat16", bucket_bytes=SMALL)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(engine(engine_dir, tp=tp)) for _ in range(engines)]
        results = launch(2, run_delta_updates, case, [s.url for s in servers], 4, LR)
        held = [s.engine.call(HeldWeights()) for s in servers]
    reports = results[0]["reports"]
    assert all(r.transport == "p2p" and r.reason.startswith(f"{engines} engines at the trainer's TP {tp}")
               for r in reports), reports[0].reason
    assert [(r.delta.full, r.delta.checked) for r in reports] == [(True, True)] + [(False, True)] * 3
    assert all(r.metadata_ahead for r in reports)  # each delta's header on the wire, before its payload
    for ranks in held:
        assert_held(ranks, results[0]["tensors"])


def test_resharded_moe_ep2_delta_updates(tmp_path):
    """Qwen3-MoE trained with EP 2 into an engine at TP 1: each EP rank encodes its own experts (and the rank that
    sends the dense tensors, those) against its own snapshot; every update checked, the engine's tensors the
    trainer's bit for bit."""
    model_dir = save_random_checkpoint(preset_config("tiny-qwen3-moe"), tmp_path / "moe", seed=124)
    src = save_random_checkpoint(preset_config("tiny-qwen3-moe"), tmp_path / "src", seed=125)
    case = Case(src, Layout(1, 1, ep=2), dtype="bfloat16", bucket_bytes=SMALL)
    with engine(model_dir, tp=1) as server:
        results = launch(2, run_delta_updates, case, server.url, 3, LR)
        held = server.engine.call(HeldWeights())
    reports = results[0]["reports"]
    assert all(r.transport == "p2p" and "resharded P2P" in r.reason for r in reports), reports[0].reason
    assert [(r.delta.full, r.delta.checked) for r in reports] == [(True, True), (False, True), (False, True)]
    assert all(r.metadata_ahead for r in reports)
    assert_held(held, _as_transformers_holds(results[0]["tensors"], src, tmp_path / "streamed"))


def _as_transformers_holds(tensors: dict[str, torch.Tensor], config_dir: str, out) -> dict[str, torch.Tensor]:
    """The streamed HF tensors as transformers holds them (the engine's model: experts fused): written as a
    checkpoint with ``config_dir``'s config and loaded in bf16."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out.mkdir()
    shutil.copy(f"{config_dir}/config.json", out / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).state_dict()


def test_resharded_corrupted_delta_caught(sources, engine_dir):
    """Resharded P2P (trainer TP 2 into an engine at TP 1, which hears both trainer ranks per bucket): one trainer
    rank's delta part arrives corrupted; the check names the bucket, the update goes again in full, and the next is
    a checked delta again, the engine holding the trainer's tensors bit for bit."""
    case = Case(sources["tiny-qwen3"], Layout(2), dtype="bfloat16", bucket_bytes=SMALL)
    with engine(engine_dir, fault="corrupt_delta@1") as server:
        server.routes[("GET", "/get_server_info")] = server.server_info  # every capability, as a faultless one
        results = launch(2, run_delta_updates, case, server.url, 3, LR)
        held = server.engine.call(HeldWeights())
    first, caught, after = (r.delta for r in results[0]["reports"])
    assert "resharded P2P" in results[0]["reports"][1].reason
    assert all(r.metadata_ahead for r in results[0]["reports"])  # the corrupted part's header came on the wire
    assert (first.full, first.checked, first.mismatch) == (True, True, None)
    assert caught.mismatch == (f"engine {server.url}: the bytes it applied of buckets [1] differ from the trainer's "
                               "(checksums)")
    assert (caught.full, caught.checked, caught.reason) == (True, True, f"the check of the last attempt found: "
                                                                        f"{caught.mismatch}")
    assert (after.full, after.checked, after.mismatch) == (False, True, None)
    assert_held(held, results[0]["tensors"])


def _without_delta(server) -> None:
    """The engine's server info without the ``delta`` capability (an engine that cannot apply deltas)."""
    route = ("GET", "/get_server_info")
    info = server.routes[route]

    def without(body):
        status, reply = info(body)
        return status, {**reply, "capabilities": [c for c in reply["capabilities"] if c != "delta"]}

    server.routes[route] = without


def test_full_updates_where_deltas_cannot_go(engine_dir):
    """An engine that does not declare ``delta`` gets full updates: the report says why, nothing is encoded or
    checked, and the engine holds the trainer's tensors."""
    trainer = Trainer(seed=3)
    with engine(engine_dir) as server:
        _without_delta(server)
        with WeightSync([server.url], bucket_bytes=SMALL, delta=True) as sync:
            for step in range(2):
                trainer.step()
                d = _update(sync, trainer, f"v{step}").delta
                assert (d.full, d.encoded, d.checked, d.wire_bytes) == (True, False, False, 0)
                assert d.reason == (f"engines ['{server.url}'] do not apply deltas by broadcast "
                                    "(they do not declare 'delta')")
                assert_engine_holds(server, trainer)
        assert server.engine.delta_base is None


def test_delta_updates_over_ipc(engine_dir):
    """Colocated (shared memory on the CPU): a delta-mode update goes ahead through buffers, not written into the
    engine's weights (the engine keeps each bucket's bytes to apply the next delta to); each payload crosses as
    the snapshot encodes it, and the engine holds the trainer's tensors bit for bit after every update, checked
    by its checksums. Then the same engine updated by another trainer's plain update (once this one has let go of
    the engine: one trainer at a time holds it over IPC) forces a full one."""
    trainer = Trainer(seed=5)
    with engine(engine_dir) as server:
        with WeightSync([server.url], transport="ipc", bucket_bytes=SMALL, delta=True) as sync:
            for step in range(5):
                trainer.step()
                report = sync.update(trainer.model, trainer.config, weight_version=f"w{step}")
                d = report.delta
                assert report.transport == "ipc" and not report.direct
                assert (d.full, d.encoded, d.checked) == (step == 0, True, True), d.summary()
                assert d.encodings.get("dense", 0) < report.buckets or step == 0
                assert_engine_holds(server, trainer)
            assert server.engine.delta_base == f"{server.engine.instance}/w4"
            sync.close()
            with WeightSync([server.url], transport="ipc", bucket_bytes=SMALL) as plain:
                trainer.step()
                assert plain.update(trainer.model, trainer.config, weight_version="other").delta is None
            assert server.engine.delta_base is None
            trainer.step()
            d = sync.update(trainer.model, trainer.config, weight_version="w5").delta
            assert d.full and d.checked and "restarted, rolled back or updated elsewhere" in d.reason
            assert_engine_holds(server, trainer)


def test_two_engines_one_at_tp2(engine_dir):
    """One broadcast group to an engine at TP 2 and one at TP 1: every rank of each keeps the buckets' bytes,
    applies the deltas and reports its checksums; each engine holds the trainer's tensors bit for bit (the TP 2
    engine's shards joined)."""
    trainer = Trainer(seed=4)
    with engine(engine_dir, tp=2) as a, engine(engine_dir) as b, \
            WeightSync([a.url, b.url], bucket_bytes=SMALL, delta=True) as sync:
        for step in range(4):
            trainer.step()
            d = _update(sync, trainer, f"v{step}").delta
            assert (d.full, d.checked) == (step == 0, True), d.summary()
            for server in (a, b):
                assert_engine_holds(server, trainer)
        assert len(a.engine.call(DeltaChecksums())) == 2


def test_moe_delta_updates(tmp_path):
    """Qwen3-MoE (routed experts fused in memory, a router per layer): deltas checked, and the engine's tensors
    (as transformers holds them on both sides) equal to the trainer's bit for bit."""
    model_dir = save_random_checkpoint(preset_config("tiny-qwen3-moe"), tmp_path / "moe", seed=123)
    trainer = Trainer(seed=5, preset="tiny-qwen3-moe")
    with engine(model_dir) as server, WeightSync([server.url], bucket_bytes=SMALL, delta=True) as sync:
        for step in range(3):
            trainer.step()
            report = _update(sync, trainer, f"v{step}")
            assert (report.delta.full, report.delta.checked) == (step == 0, True), report.summary()
            assert_engine_holds(server, trainer)
        assert 0 < report.delta.wire_bytes < report.bytes / 2
