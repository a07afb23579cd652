"""The IPC sink's plan (weightstream.sinks.ipc_plan): what one update does, decided from the sink's options, what
the engine offers and what the stream is. Pure: no process, no device."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from weightstream.sinks.ipc_plan import EngineOffer, IPCOptions, IPCPlan, Purpose, Route, StreamShape, plan_ipc

pytestmark = pytest.mark.unit

URL = "http://127.0.0.1:9"
CHANNELS = EngineOffer(URL, tp_size=1, keeps_channels=True, deltas_ahead=True)  # the reference engine at TP 1
POSTS = EngineOffer(URL, tp_size=1, keeps_channels=False)  # an engine without ipc_ahead (SGLang)
LOADER = EngineOffer(URL, tp_size=1, deltas_per_bucket=True)  # SGLang with weightstream's loader (ipc_delta)
GPU = StreamShape(buckets=3, writable=True, reuses_buffers=True)
CPU = replace(GPU, on_cpu=True)


def test_ahead_into_lent_buffers_then_the_engine_s_offer_of_its_weights():
    plan = plan_ipc(IPCOptions(), CHANNELS, GPU, rank=0, world=1)
    assert plan == IPCPlan(route=Route.AHEAD, engine_tp=1, sends=True, takes_offer=True, keeps_channels=True,
                           engine_holds=True)
    assert (plan.metadata_ahead, plan.writes) == (True, False)
    direct = plan.offered(True)
    assert direct == replace(plan, route=Route.DIRECT)
    assert (direct.metadata_ahead, direct.writes) == (True, True)
    assert plan.offered(False) == plan


def test_no_direct_writes_where_the_options_the_stream_or_a_delta_say_no():
    for options, stream in [(IPCOptions(direct=False), GPU), (IPCOptions(checksums=True), GPU),
                            (IPCOptions(), replace(GPU, writable=False)), (IPCOptions(), replace(GPU, deltas=True))]:
        plan = plan_ipc(options, CHANNELS, stream, rank=0, world=1)
        assert (plan.route, plan.takes_offer) == (Route.AHEAD, False)
        assert plan.offered(True) == plan
        assert plan.deltas == stream.deltas


def test_per_bucket_to_an_engine_without_channels_holds_and_announces_nothing():
    plan = plan_ipc(IPCOptions(), POSTS, CPU, rank=0, world=1)
    assert plan == IPCPlan(route=Route.PER_BUCKET, engine_tp=1, sends=True)
    assert (plan.metadata_ahead, plan.writes) == (False, False)


def test_per_bucket_on_the_cpu_to_a_channel_engine_announces_once_until_released():
    first = plan_ipc(IPCOptions(ahead=False), CHANNELS, CPU, rank=0, world=1)
    assert first == IPCPlan(route=Route.PER_BUCKET, engine_tp=1, sends=True, announce=True, keeps_channels=True,
                            announced=True, engine_holds=True)
    second = plan_ipc(IPCOptions(ahead=False), CHANNELS, CPU, rank=0, world=1, before=first)
    assert second == replace(first, announce=False)
    released = second.released()
    assert (released.announce, released.announced, released.engine_holds) == (False, False, False)
    third = plan_ipc(IPCOptions(ahead=False), CHANNELS, CPU, rank=0, world=1, before=released)
    assert third == first
    on_gpu = plan_ipc(IPCOptions(ahead=False), CHANNELS, GPU, rank=0, world=1)
    assert (on_gpu.announce, on_gpu.announced, on_gpu.engine_holds) == (False, False, False)


def test_ranks_past_the_engine_s_tp_send_nothing():
    engine = EngineOffer(URL, tp_size=2, keeps_channels=True)
    sends = [plan_ipc(IPCOptions(), engine, GPU, rank=r, world=4).sends for r in range(4)]
    assert sends == [True, True, False, False]


def test_an_empty_stream_goes_per_bucket_and_keeps_nothing_new():
    plan = plan_ipc(IPCOptions(), CHANNELS, replace(CPU, buckets=0, deltas=True), rank=0, world=1)
    assert plan == IPCPlan(route=Route.PER_BUCKET, engine_tp=1, sends=True, deltas=True, keeps_channels=True)


def test_a_preparation_runs_ahead_where_there_is_something_to_map_and_never_writes():
    plan = plan_ipc(IPCOptions(), CHANNELS, GPU, rank=0, world=1, purpose=Purpose.PREPARE)
    assert plan == IPCPlan(purpose=Purpose.PREPARE, route=Route.AHEAD, engine_tp=1, sends=True, takes_offer=True,
                           prepares=True, keeps_channels=True, engine_holds=True)
    assert plan.offered(True).route is Route.DIRECT and not plan.offered(True).writes
    nothing = replace(GPU, writable=False, reuses_buffers=False)
    assert not plan_ipc(IPCOptions(), CHANNELS, nothing, rank=0, world=1, purpose=Purpose.PREPARE).prepares
    assert not plan_ipc(IPCOptions(), POSTS, GPU, rank=0, world=1, purpose=Purpose.PREPARE).prepares
    per_bucket = plan_ipc(IPCOptions(ahead=False), CHANNELS, CPU, rank=0, world=1, purpose=Purpose.PREPARE)
    assert (per_bucket.prepares, per_bucket.announce, per_bucket.announced) == (False, False, False)


def test_deltas_one_request_per_bucket_where_the_engine_takes_them_so():
    for options, stream in itertools.product((IPCOptions(), IPCOptions(ahead=False)), (GPU, CPU)):
        plan = plan_ipc(options, LOADER, replace(stream, deltas=True), rank=0, world=1)
        assert plan == IPCPlan(route=Route.PER_BUCKET, engine_tp=1, sends=True, deltas=True)
    # an engine that keeps channels but takes deltas only per bucket: a delta update goes per bucket (and, on the
    # CPU, announces itself as any per-bucket update to such an engine), a plain one ahead
    both = replace(LOADER, keeps_channels=True)
    plan = plan_ipc(IPCOptions(), both, replace(CPU, deltas=True), rank=0, world=1)
    assert plan == IPCPlan(route=Route.PER_BUCKET, engine_tp=1, sends=True, deltas=True, announce=True,
                           keeps_channels=True, announced=True, engine_holds=True)
    assert plan_ipc(IPCOptions(), both, GPU, rank=0, world=1).route is Route.AHEAD
    # one that takes them both ways: ahead where the sync sends the metadata ahead
    every = replace(both, deltas_ahead=True)
    assert plan_ipc(IPCOptions(), every, replace(GPU, deltas=True), rank=0, world=1).route is Route.AHEAD
    assert plan_ipc(IPCOptions(ahead=False), every, replace(GPU, deltas=True), rank=0, world=1).route \
        is Route.PER_BUCKET


def test_every_problem_in_one_error():
    bad = replace(GPU, full=False, deltas=True)
    with pytest.raises(ValueError) as caught:
        plan_ipc(IPCOptions(ahead=False), EngineOffer(URL, tp_size=2, keeps_channels=False), bad, rank=0, world=1)
    assert str(caught.value) == (
        "IPCSink sends whole tensors: it needs a full stream; engine TP 2 needs as many colocated trainer ranks; "
        f"the job has 1; a delta update over IPC goes ahead or one request per bucket: the engine at {URL} must "
        "declare delta and ipc_ahead (it does not) with the sync sending the metadata ahead (metadata_ahead=False), "
        "or ipc_delta (it does not)")
    with pytest.raises(ValueError) as caught:  # channels, but no deltas on them: nor per bucket
        plan_ipc(IPCOptions(), EngineOffer(URL, keeps_channels=True), replace(GPU, deltas=True), rank=0, world=1)
    assert str(caught.value) == (
        f"a delta update over IPC goes ahead or one request per bucket: the engine at {URL} must declare delta and "
        "ipc_ahead (it does not) with the sync sending the metadata ahead, or ipc_delta (it does not)")


def _every_input():
    flags = (False, True)
    for ahead, direct, checksums, channels, deltas_ahead, per_bucket, tp, buckets, cpu, writable, reuses, deltas, \
            rank, purpose, held in itertools.product(flags, flags, flags, flags, flags, flags, (1, 2), (0, 3), flags,
                                                     flags, flags, flags, (0, 1), tuple(Purpose), flags):
        before = IPCPlan(announced=held, engine_holds=held)
        yield (IPCOptions(ahead, direct, checksums), EngineOffer(URL, tp, channels, deltas_ahead, per_bucket),
               StreamShape(True, buckets, cpu, writable, reuses, deltas), rank, purpose, before)


def _goes_ahead(options: IPCOptions, engine: EngineOffer, stream: StreamShape) -> tuple[bool, bool]:
    """The rules, written out: (ahead, refused). Deltas go ahead where the engine takes them there, else one request
    per bucket where it takes them so, else they are refused."""
    can_ahead = options.ahead and engine.keeps_channels and stream.buckets > 0
    if not (stream.deltas and stream.buckets > 0):
        return can_ahead, False
    if can_ahead and engine.deltas_ahead:
        return True, False
    if engine.deltas_per_bucket:
        return False, False
    return can_ahead, True


def test_every_combination_follows_the_rules():
    planned = refused = 0
    for options, engine, stream, rank, purpose, before in _every_input():
        ahead, refuse = _goes_ahead(options, engine, stream)
        if refuse:
            with pytest.raises(ValueError, match="a delta update over IPC goes ahead or one request per bucket"):
                plan_ipc(options, engine, stream, rank=rank, world=2, purpose=purpose, before=before)
            refused += 1
            continue
        plan = plan_ipc(options, engine, stream, rank=rank, world=2, purpose=purpose, before=before)
        planned += 1
        assert plan.route is (Route.AHEAD if ahead else Route.PER_BUCKET)
        assert (plan.engine_tp, plan.sends, plan.deltas, plan.purpose) == (
            engine.tp_size, rank < engine.tp_size, stream.deltas, purpose)
        assert plan.takes_offer == (ahead and options.direct and not options.checksums and not stream.deltas
                                    and stream.writable)
        announce = (not ahead and engine.keeps_channels and stream.on_cpu and stream.buckets > 0
                    and purpose is Purpose.UPDATE and not before.announced)
        assert (plan.announce, plan.announced) == (announce, before.announced or announce)
        assert plan.engine_holds == (before.engine_holds or ahead or announce)
        assert plan.prepares == (purpose is Purpose.PREPARE and ahead and (stream.writable or stream.reuses_buffers))
        for offered in (False, True):
            after = plan.offered(offered)
            assert after.route is (Route.DIRECT if offered and plan.takes_offer else plan.route)
            assert after.writes == (offered and plan.takes_offer and purpose is Purpose.UPDATE)
            assert after.released() == replace(plan, announce=False, announced=False, engine_holds=False)
    assert (planned, refused) == (29184, 3584)
