"""Every delivery path, the disk included, is a Sink; serialisation and checksums on their own."""

from __future__ import annotations

import base64
import inspect
import os
import pickle

import pytest
import torch

from weightstream.engines import ReferenceEngine
from weightstream.models.presets import preset_config
from weightstream.sinks import BroadcastSink, IPCSink, P2PSink, SafetensorsSink, Sink
from weightstream.sinks.reshard import ReshardSink
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import Bucket
from weightstream.wire.handles import UnsafePayloadError, checksum, dumps_b64, loads_b64

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset


def _sink_classes() -> list[type]:
    """Every sink weightstream has: the classes of weightstream.sinks' modules named ``*Sink`` that are not the
    protocol or a base other sinks build on."""
    import importlib
    import pkgutil

    import weightstream.sinks as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"weightstream.sinks.{info.name}")
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and name.endswith("Sink") and obj.__module__ == module.__name__
                    and obj is not Sink and not any(obj in c.__mro__[1:] for c in found.values())):
                found[name] = obj
    return [c for c in found.values() if not any(c in o.__mro__[1:] for o in found.values())]


def test_every_sink_has_the_interface_s_signatures():
    """Each sink's methods take exactly the parameters, kinds, defaults and annotations the Sink protocol
    declares (not only the names); and each instance of every sink is a Sink."""
    classes = {c.__name__ for c in _sink_classes()}
    assert classes == {"BroadcastSink", "IPCSink", "P2PSink", "ReshardSink", "SafetensorsSink"}
    methods = [m for m in vars(Sink) if not m.startswith("_") and callable(getattr(Sink, m))]
    assert sorted(methods) == ["abort", "close", "connect", "delivery", "disconnect", "open", "prepare", "send",
                               "share_digests"]
    wrong = []
    for cls in _sink_classes():
        for method in methods:
            want, got = inspect.signature(getattr(Sink, method)), inspect.signature(getattr(cls, method))
            if want != got:
                wrong.append(f"{cls.__name__}.{method}{got}, the protocol: {want}")
    assert wrong == []


def test_every_sink_defines_every_method_of_the_interface_itself():
    """No sink's method is the protocol's documented stub: each comes from the sink's own class or a base of
    weightstream's sinks (PipelinedSink)."""
    methods = [m for m in vars(Sink) if not m.startswith("_") and callable(getattr(Sink, m))]
    stubs = []
    for cls in _sink_classes():
        for method in methods:
            owner = next(c for c in cls.__mro__ if method in vars(c))
            if owner is Sink or not owner.__module__.startswith("weightstream.sinks."):
                stubs.append(f"{cls.__name__}.{method} from {owner.__qualname__}")
    assert stubs == []


def test_each_sink_is_a_sink_with_its_name(tmp_path):
    engine = ReferenceEngine("http://127.0.0.1:9")
    sinks = [BroadcastSink([engine]), P2PSink([engine], Topology()), IPCSink(engine), ReshardSink(engine, Topology()),
             SafetensorsSink(tmp_path, preset_config("tiny-qwen3"))]
    assert {type(s) for s in sinks} == set(_sink_classes())
    assert [s.name for s in sinks] == ["broadcast", "p2p", "ipc", "p2p", "safetensors"]
    assert all(isinstance(s, Sink) for s in sinks)


def test_a_packed_bucket_is_its_tensors_and_zeros_whatever_memory_it_gets(monkeypatch):
    """The bytes between tensors (alignment) are zero, not what the allocator left there: a bucket's checksum and
    its delta against the engine's copy depend on its tensors alone."""
    named = [("a", torch.arange(3, dtype=torch.int8)), ("b", torch.full((5,), 7.0, dtype=torch.bfloat16)),
             ("c", torch.ones(1, dtype=torch.float32))]
    clean = Bucket.pack(named)
    empty = torch.empty

    def dirty(*args, **kwargs):  # memory as a reused allocation hands it out: every byte set
        return empty(*args, **kwargs).fill_(0xAB) if kwargs.get("dtype") == torch.uint8 else empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", dirty)
    packed = Bucket.pack(named)
    assert torch.equal(packed.buffer, clean.buffer) and checksum(packed.buffer) == checksum(clean.buffer)
    used = torch.zeros(packed.buffer.numel(), dtype=torch.bool)
    for m in packed.metas:
        used[m.offset:m.offset + m.nbytes] = True
    assert int(used.logical_not().sum()) > 0 and int(packed.buffer[~used].abs().sum()) == 0


def test_bucket_payload_round_trip_and_refusals():
    a, b = torch.randn(3, 5), torch.arange(7, dtype=torch.int64)
    bucket = Bucket.pack([("a", a), ("b", b.to(torch.bfloat16))])
    obj = loads_b64(ReferenceEngine("http://127.0.0.1:9").encode_ipc(bucket))
    rebuilt = Bucket(0, obj["flattened_tensor"], bucket.metas)
    got = dict(rebuilt.named_tensors())
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b.to(torch.bfloat16))
    assert [(m.name, m.start_idx, m.end_idx, m.numel) for m in obj["metadata"]] == [
        (m.name, m.offset, m.offset + m.nbytes, m.nbytes) for m in bucket.metas
    ]
    assert loads_b64(dumps_b64({"x": [1, 2.5, "s"]})) == {"x": [1, 2.5, "s"]}
    for evil in (pickle.dumps(os.system), pickle.dumps(eval), pickle.dumps(getattr)):
        with pytest.raises(UnsafePayloadError, match="refused to unpickle global"):
            loads_b64(base64.b64encode(evil))
    with pytest.raises(UnsafePayloadError, match="base64"):
        loads_b64("not base64 !!")


def test_checksum_sees_a_flipped_byte_and_a_swap():
    buf = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    buf[0], buf[4] = 1, 2
    ref = checksum(buf)
    flipped = buf.clone()
    flipped[2048] ^= 1
    swapped = buf.clone()
    swapped[[0, 4]] = buf[[4, 0]]
    assert checksum(buf.clone()) == ref
    assert checksum(flipped) != ref
    assert checksum(swapped) != ref
