"""Every delivery path, the disk included, is a Sink; serialisation and checksums on their own."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from weightstream.engines import ReferenceEngine
from weightstream.models.presets import preset_config
from weightstream.sinks import BroadcastSink, IPCSink, P2PSink, SafetensorsSink, Sink
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import Bucket
from weightstream.wire.handles import UnsafePayloadError, checksum, dumps_b64, loads_b64

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset


def test_all_sinks_share_the_interface(tmp_path):
    engine = ReferenceEngine("http://127.0.0.1:9")
    sinks = [BroadcastSink([engine]), P2PSink([engine], Topology()), IPCSink(engine),
             SafetensorsSink(tmp_path, preset_config("tiny-qwen3"))]
    assert [s.name for s in sinks] == ["broadcast", "p2p", "ipc", "safetensors"]
    assert all(isinstance(s, Sink) for s in sinks)


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
