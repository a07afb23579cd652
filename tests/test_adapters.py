"""The engine seam: the transport is chosen from what engines declare, and each adapter's requests are the
engine's own field names (sinks reach engines only through the protocols: tests/test_architecture.py)."""

from __future__ import annotations

import pytest

from weightstream.converters.registry import model_spec
from weightstream.engines import ADAPTERS, EngineAdapter, EngineInfo, ReferenceEngine, SGLangEngine
from weightstream.engines.base import BROADCAST, IPC, P2P, ROLLBACK
from weightstream.models.presets import preset_config
from weightstream.sources.topology import Topology
from weightstream.update import choose_transport

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset

def test_every_adapter_is_an_engine_adapter():
    for cls in ADAPTERS.values():
        assert isinstance(cls("http://127.0.0.1:9"), EngineAdapter), cls


class Declared(ReferenceEngine):
    """An adapter whose engine declares ``info`` without being asked over HTTP (the choice is pure)."""

    def __init__(self, url: str, info: EngineInfo):
        super().__init__(url)
        self._info = info


def _topo(tp: int = 2, ep: int = 1) -> Topology:
    return Topology(tp_size=tp, tp_rank=0, pp_size=1, pp_rank=0, ep_size=ep, ep_rank=0, etp_size=tp, etp_rank=0)


SPEC = model_spec(preset_config("tiny-qwen3"))


@pytest.mark.parametrize("caps,tp,engines,requested,expected", [
    ({BROADCAST, IPC, P2P, ROLLBACK}, 2, 1, "auto", "p2p"),
    ({BROADCAST, IPC}, 2, 1, "auto", "broadcast"),  # SGLang: no per-rank buckets
    ({BROADCAST, IPC, P2P}, 1, 1, "auto", "broadcast"),  # engine TP 1 != trainer TP 2
    ({BROADCAST, IPC, P2P}, 2, 2, "p2p", "p2p"),  # two engines at the trainer's TP: each from its replica
    ({BROADCAST, IPC, P2P}, 1, 2, "p2p", "broadcast"),  # two engines of another TP: fall back
    ({IPC}, 2, 1, "ipc", "ipc"),
])
def test_transport_is_chosen_from_declared_capabilities(caps, tp, engines, requested, expected):
    adapters = [Declared(f"http://e{i}", EngineInfo("x", tp_size=tp, capabilities=frozenset(caps)))
                for i in range(engines)]
    kind, reason = choose_transport(requested, adapters, _topo(), SPEC, colocated=False)
    assert kind == expected, reason


def test_no_transport_fits_is_one_clear_error():
    ipc_only = Declared("http://e", EngineInfo("x", tp_size=1, capabilities=frozenset({IPC})))
    with pytest.raises(ValueError, match=r"no transport fits: P2P preconditions failed: .*do not receive broadcasts"):
        choose_transport("auto", [ipc_only], _topo(), SPEC, colocated=False)
    with pytest.raises(ValueError, match="do not receive IPC buckets"):
        choose_transport("ipc", [Declared("http://e", EngineInfo("x", capabilities=frozenset({BROADCAST})))],
                         _topo(), SPEC, colocated=False)


def test_sglang_adapter_does_not_claim_what_sglang_lacks():
    info = SGLangEngine("http://x").capabilities({})
    assert P2P not in info and ROLLBACK not in info and {BROADCAST, IPC} <= info


def test_weight_layout_must_match_every_engine():
    from weightstream.update import check_formats
    from weightstream.wire.fp8 import BlockFP8, block_fp8_of

    fp8 = BlockFP8()
    plain = Declared("http://plain", EngineInfo("x"))
    quantized = Declared("http://fp8", EngineInfo("x", fp8=fp8))
    check_formats([plain], None)
    check_formats([quantized], fp8)
    with pytest.raises(ValueError, match=r"sends unquantized weights, but engine http://fp8 serves block FP8"):
        check_formats([plain, quantized], None)
    with pytest.raises(ValueError, match=r"sends block FP8 \(128, 128\).*http://plain serves unquantized"):
        check_formats([plain, quantized], fp8)
    with pytest.raises(ValueError, match=r"http://fp8 serves block FP8 .*\(ue8m0 scales\)"):
        check_formats([Declared("http://fp8", EngineInfo("x", fp8=BlockFP8(scale_fmt="ue8m0")))], fp8)
    assert block_fp8_of({"quant_method": "fp8", "weight_block_size": [128, 128]}) == fp8
    assert block_fp8_of({"quant_method": "fp8", "weight_block_size": [64, 32], "scale_fmt": "ue8m0"}) == BlockFP8(
        (64, 32), "ue8m0")
    assert block_fp8_of({"quant_method": "fp8"}) is None and block_fp8_of(None) is None
