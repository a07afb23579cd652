"""A kept plan's two checks on a real transformers model, in this process: ``ModuleGuard.addresses_hold`` (launching
the plan's copies is memory safe: every storage they read alive and where it was) and ``ModuleGuard.holds`` (the plan
is still the model's); and a stream that defers the full check (``stream_hf_weights(confirm_later=True)``, then
``confirm_plan``), which reuses the kept plan on the addresses alone and finds out, after its copies, that a
parameter re-pointed or replaced since made them read stale bytes: the plan is forgotten and the next stream makes a
new one. A stream without the deferred check still plans afresh before its copies."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from weightstream.models.presets import preset_config, random_hf_model
from weightstream.sources.base import ModuleGuard
from weightstream.sources.names import WEIGHT_BUFFERS
from weightstream.streaming.kept_plans import clear_plans
from weightstream.streaming.stream import BucketStream, confirm_plan, stream_hf_weights

pytestmark = pytest.mark.unit

CFG = preset_config("tiny-qwen3")
SMALL = 60_000  # bytes per bucket: the tiny model travels in several buckets
Q = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture
def model() -> nn.Module:
    clear_plans()
    m = random_hf_model(CFG, seed=7, dtype=torch.bfloat16)
    yield m
    clear_plans()


def _stream(model: nn.Module, **kw) -> BucketStream:
    return stream_hf_weights(model, CFG, bucket_bytes=SMALL, reuse_buffers=True, **kw)


def _drained(stream: BucketStream) -> dict[str, torch.Tensor]:
    """Every tensor the stream yields, by name (copied out: the kept buffers are packed again)."""
    return {name: t.clone() for b in stream for name, t in b.named_tensors()}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def _is_the_model(got: dict[str, torch.Tensor], model: nn.Module) -> bool:
    """What a stream yielded is the model's tensors as they stand, bit for bit."""
    ours = model.state_dict()
    return bool(got) and all(_same_bits(t, ours[n]) for n, t in got.items())


def _param(model: nn.Module, name: str) -> nn.Parameter:
    return model.get_parameter(name)


def _move_storage(p: torch.Tensor) -> int:
    """Free ``p``'s storage and allocate it again elsewhere (what an offload does), its values put back; the old
    address."""
    saved = p.detach().clone()
    storage = p.untyped_storage()
    old, nbytes = storage.data_ptr(), storage.nbytes()
    storage.resize_(0)
    blocker = torch.empty(nbytes, dtype=torch.uint8)  # may take the freed block: the storage comes back elsewhere
    storage.resize_(nbytes)
    with torch.no_grad():
        p.copy_(saved)
    assert storage.data_ptr() != old and blocker.numel() == nbytes
    return old


def test_addresses_hold_while_nothing_moved_not_after_a_storage_is_allocated_again(model):
    guard = ModuleGuard([model], WEIGHT_BUFFERS)
    assert len(guard.storages) == len(guard.addresses) > 0
    assert guard.addresses_hold([model]) and guard.holds([model])
    with torch.no_grad():  # what an optimizer step does: values in place
        for p in model.parameters():
            p.mul_(2)
    assert guard.addresses_hold([model]) and guard.holds([model])
    assert not guard.addresses_hold([random_hf_model(CFG, seed=7, dtype=torch.bfloat16)])  # other modules
    _move_storage(_param(model, Q))  # resize_(0) then resize_(n): the plan's addresses would be freed memory
    assert not guard.addresses_hold([model])
    assert not guard.holds([model])


def test_a_re_pointed_or_replaced_parameter_passes_the_addresses_check_not_the_full_one(model):
    guard = ModuleGuard([model], WEIGHT_BUFFERS)
    q = _param(model, Q)
    q.data = q.data.clone() + 1  # re-pointed: the old storage alive (the guard holds it) and unmoved
    assert guard.addresses_hold([model]) and not guard.holds([model])

    guard = ModuleGuard([model], WEIGHT_BUFFERS)
    down = model.model.layers[1].mlp.down_proj
    down.weight = nn.Parameter(torch.randn_like(down.weight))  # replaced under the same name
    assert guard.addresses_hold([model]) and not guard.holds([model])

    guard = ModuleGuard([model], WEIGHT_BUFFERS)
    layer = model.model.layers[0]
    layer.input_layernorm = copy.deepcopy(layer.input_layernorm)  # a submodule replaced: every dict the same size
    assert not guard.addresses_hold([model]) and not guard.holds([model])


def test_a_plain_stream_plans_afresh_when_a_parameter_was_replaced(model):
    first = _stream(model)
    assert first.stats.planned and _is_the_model(_drained(first), model) and confirm_plan(first)
    again = _stream(model)
    assert not again.stats.planned and _is_the_model(_drained(again), model) and confirm_plan(again)
    q = _param(model, Q)
    q.data = q.data.clone() + 1
    replanned = _stream(model)  # the full check before any copy: a new plan, the new values
    assert replanned.stats.planned and _is_the_model(_drained(replanned), model) and confirm_plan(replanned)
    down = model.model.layers[1].mlp.down_proj
    down.weight = nn.Parameter(torch.randn_like(down.weight))
    replaced = _stream(model)
    assert replaced.stats.planned and _is_the_model(_drained(replaced), model)
    kept = _stream(model)
    assert not kept.stats.planned and _is_the_model(_drained(kept), model)


def test_a_deferred_check_reuses_the_plan_then_finds_it_stale_and_forgets_it(model):
    first = _stream(model, confirm_later=True)
    assert first.stats.planned and _is_the_model(_drained(first), model) and confirm_plan(first)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    again = _stream(model, confirm_later=True)  # values changed in place: the plan holds
    assert not again.stats.planned and _is_the_model(_drained(again), model) and confirm_plan(again)

    q = _param(model, Q)
    old = q.detach().clone()
    q.data = q.data.clone() * 3  # re-pointed between streams
    stale = _stream(model, confirm_later=True)  # reused on the addresses: its copies read the old storage
    assert not stale.stats.planned
    got = _drained(stale)
    assert _same_bits(got[Q], old) and not _same_bits(got[Q], q.detach())  # valid memory, stale bytes
    assert not confirm_plan(stale)  # the full check: no; the plan is forgotten

    fresh = _stream(model, confirm_later=True)
    assert fresh.stats.planned and _is_the_model(_drained(fresh), model) and confirm_plan(fresh)
    kept = _stream(model, confirm_later=True)
    assert not kept.stats.planned and _is_the_model(_drained(kept), model) and confirm_plan(kept)


def test_a_stale_plan_found_late_leaves_the_new_plan_a_plain_stream_made_meanwhile(model):
    _drained(_stream(model, confirm_later=True))
    down = model.model.layers[1].mlp.down_proj
    down.weight = nn.Parameter(torch.randn_like(down.weight))
    stale = _stream(model, confirm_later=True)
    assert not stale.stats.planned and not _is_the_model(_drained(stale), model)
    plain = _stream(model)  # the full check: a new plan, kept in the old one's place
    assert plain.stats.planned and _is_the_model(_drained(plain), model)
    assert not confirm_plan(stale)  # forgets the stale plan only
    kept = _stream(model, confirm_later=True)
    assert not kept.stats.planned and _is_the_model(_drained(kept), model) and confirm_plan(kept)


def test_a_deferred_check_plans_afresh_when_a_storage_was_allocated_again(model):
    first = _stream(model, confirm_later=True)
    assert first.stats.planned and confirm_plan(first)
    _drained(first)
    _move_storage(_param(model, DOWN))
    moved = _stream(model, confirm_later=True)  # the addresses check fails before any copy: a new plan
    assert moved.stats.planned and _is_the_model(_drained(moved), model) and confirm_plan(moved)
