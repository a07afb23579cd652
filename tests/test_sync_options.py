"""The options of a WeightSync: one frozen object of four groups, checked once (one error listing every problem),
made from the flat keywords too, each field's default and meaning declared where the field is."""

from __future__ import annotations

import ast
import inspect
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest

from weightstream.streaming.stream import DEFAULT_BUCKET_BYTES
from weightstream.update import (
    EngineOptions,
    OptionsError,
    PayloadOptions,
    SafetyOptions,
    SyncOptions,
    TransferOptions,
    WeightSync,
)
from weightstream.update import options as options_module
from weightstream.wire.fp8 import BlockFP8

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset

GROUPS = (EngineOptions, TransferOptions, PayloadOptions, SafetyOptions)


def test_every_problem_is_listed_in_one_error():
    with pytest.raises(OptionsError) as caught:
        SyncOptions.of(engine="nope", timeout_s=0, group_name="", master_port=70000, backend="mpi",
                       engine_fp8="e4m3", transport="tcp", colocated="yes", bucket_bytes=-1, reuse_buffers=None,
                       quantize=1, full_every=0, snapshot="disk", checksums=1, pause_mode="stop")
    assert caught.value.problems == [
        "engine must be one of ('auto', 'lmdeploy', 'reference', 'sglang', 'vllm'), got 'nope'",
        "timeout_s must be a positive number, got 0",
        "group_name must be a non-empty string, got ''",
        "master_port must be a port number (1 to 65535) or None, got 70000",
        "backend must be one of ('nccl', 'gloo'), got 'mpi'",
        "engine_fp8 must be a BlockFP8 or None, got 'e4m3'",
        "transport must be one of ('auto', 'ipc', 'broadcast', 'p2p'), got 'tcp'",
        "colocated must be True, False or None, got 'yes'",
        "bucket_bytes must be a positive integer, got -1",
        "reuse_buffers must be True or False, got None",
        "quantize must be a BlockFP8 or None, got 1",
        "full_every must be a positive integer, got 0",
        "snapshot must be one of ('device', 'host'), got 'disk'",
        "full_every applies to delta updates (delta=True)",
        "checksums must be True or False, got 1",
        "pause_mode must be one of ('abort', 'retract', 'in_place', 'wait', 'keep'), got 'stop'",
    ]
    assert str(caught.value).startswith("16 problems with the WeightSync options: engine must be one of")
    assert isinstance(caught.value, ValueError)


def test_groups_made_by_hand_are_checked_together():
    with pytest.raises(OptionsError) as caught:
        SyncOptions(transfer=TransferOptions(transport="x"), payload=PayloadOptions(full_every=2),
                    safety=EngineOptions())  # type: ignore[arg-type]
    assert caught.value.problems == ["transport must be one of ('auto', 'ipc', 'broadcast', 'p2p'), got 'x'",
                                     "full_every applies to delta updates (delta=True)",
                                     "safety must be SafetyOptions, got EngineOptions"]


def test_unknown_keywords_are_named_all_at_once():
    with pytest.raises(TypeError, match=r"unknown WeightSync options \['bucket_size', 'transprot'\]; known: api_key, "):
        WeightSync("http://e.invalid", transprot="p2p", bucket_size=1)


def test_keywords_make_the_same_options_as_the_groups():
    flat = SyncOptions.of(transport="p2p", bucket_bytes=1 << 20, delta=True, full_every=4, checksums=True,
                          api_key="k", engine_fp8=BlockFP8())
    grouped = SyncOptions(EngineOptions(api_key="k", engine_fp8=BlockFP8()),
                          TransferOptions(transport="p2p", bucket_bytes=1 << 20),
                          PayloadOptions(delta=True, full_every=4), SafetyOptions(checksums=True))
    assert flat == grouped
    assert WeightSync("http://e.invalid", grouped).options is grouped
    assert WeightSync("http://e.invalid", transport="p2p", bucket_bytes=1 << 20, delta=True, full_every=4,
                      checksums=True, api_key="k", engine_fp8=BlockFP8()).options == grouped
    with pytest.raises(TypeError, match=r"not both \(got \['delta'\]\)"):
        WeightSync("http://e.invalid", grouped, delta=True)
    with pytest.raises(TypeError, match="options must be a SyncOptions, got str"):
        WeightSync("http://e.invalid", "p2p")  # type: ignore[arg-type]


def test_defaults():
    assert SyncOptions() == SyncOptions.of()
    assert EngineOptions() == EngineOptions("auto", None, 60.0, "weightstream", "127.0.0.1", None, None, None, None)
    assert TransferOptions() == TransferOptions("auto", None, DEFAULT_BUCKET_BYTES, True, True, True)
    assert PayloadOptions() == PayloadOptions(None, False, None, "device")
    assert SafetyOptions() == SafetyOptions(False, "abort")


def test_every_field_says_what_it_means_where_it_is_declared():
    """Each field of each group has a comment on its line or on the lines just above it."""
    source = Path(inspect.getfile(options_module)).read_text().splitlines()
    tree = ast.parse("\n".join(source))
    undocumented = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in {g.__name__ for g in GROUPS}:
            for field in (n for n in node.body if isinstance(n, ast.AnnAssign)):
                line = source[field.lineno - 1]
                above = source[field.lineno - 2].strip()
                if "#" not in line and not above.startswith("#"):
                    undocumented.append(f"{node.name}.{ast.unparse(field.target)}")
    assert undocumented == []
    assert sorted(f.name for g in GROUPS for f in fields(g)) == sorted(
        f"{name}" for name in ("engine", "api_key", "timeout_s", "group_name", "master_address", "master_port",
                               "backend", "engine_fp8", "engine_model_path", "transport", "colocated",
                               "bucket_bytes", "reuse_buffers", "metadata_ahead", "direct", "quantize", "delta",
                               "full_every", "snapshot", "checksums", "pause_mode"))


def test_adapters_get_the_layout_only_where_it_is_stated(tmp_path):
    assert EngineOptions(api_key="k", timeout_s=5).adapter_options() == {"api_key": "k", "timeout_s": 5,
                                                                         "group_name": "weightstream"}
    assert EngineOptions(engine_fp8=BlockFP8(), engine_model_path=tmp_path).adapter_options() == {
        "api_key": None, "timeout_s": 60.0, "group_name": "weightstream", "fp8": BlockFP8(),
        "model_path": str(tmp_path)}


def test_options_are_frozen_and_a_new_transport_is_checked_like_any_option():
    sync = WeightSync("http://e.invalid", transport="ipc")
    with pytest.raises(FrozenInstanceError):
        sync.options.transfer.transport = "p2p"  # type: ignore[misc]
    sync.transport = "broadcast"
    assert (sync.transport, sync.options.transfer) == ("broadcast", TransferOptions(transport="broadcast"))
    with pytest.raises(OptionsError, match=r"^1 problem with the WeightSync options: transport must be one of"):
        sync.transport = "tcp"
    assert sync.transport == "broadcast"
