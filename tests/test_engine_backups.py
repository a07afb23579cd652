"""Where the reference engine keeps an update session's rollback copies: beside the weights where they fit, else in
host memory, else nowhere (and an abort then leaves the engine refusing to serve) — the figures of an 80 GB card
holding a Qwen3-30B-A3B, and of one holding a Qwen3-8B."""

from __future__ import annotations

import pytest

from weightstream.receiver.backups import (
    DEVICE_RESERVE_BYTES,
    HOST_RESERVE_BYTES,
    BackupPlace,
    backup_place,
)

GIB = 1 << 30
QWEN3_30B_A3B = 61 * GIB  # bf16 weights
QWEN3_8B = 16 * GIB

@pytest.mark.unit
def test_a_small_model_keeps_its_copies_beside_it():
    place = backup_place(QWEN3_8B, True, device_free=60 * GIB, host_free=100 * GIB)
    assert place.where == "device" and "16.0 GiB of copies fit beside the weights (60.0 GiB free" in place.why


@pytest.mark.unit
def test_a_moe_model_on_an_80_gb_card_keeps_them_in_host_memory():
    place = backup_place(QWEN3_30B_A3B, True, device_free=17 * GIB, host_free=120 * GIB)
    assert place.where == "host"
    assert place.why == ("the GPU has 17.0 GiB free, less than 61.0 GiB of copies and a 4.0 GiB reserve: kept in "
                         "host memory")


@pytest.mark.unit
def test_with_no_room_anywhere_the_session_keeps_none_and_says_so():
    place = backup_place(QWEN3_30B_A3B, True, device_free=17 * GIB, host_free=64 * GIB)
    assert place.where == "none"
    assert "host memory has 64.0 GiB available" in place.why and "refusing to serve until a complete one" in place.why


@pytest.mark.unit
def test_the_reserves_are_kept():
    fits = QWEN3_8B + DEVICE_RESERVE_BYTES
    assert backup_place(QWEN3_8B, True, fits, 0).where == "device"
    assert backup_place(QWEN3_8B, True, fits - 1, QWEN3_8B + HOST_RESERVE_BYTES).where == "host"
    assert backup_place(QWEN3_8B, True, fits - 1, QWEN3_8B + HOST_RESERVE_BYTES - 1).where == "none"


@pytest.mark.unit
def test_on_the_cpu_the_copies_are_host_memory_beside_the_weights():
    assert backup_place(GIB, False, 0, 2 * GIB).where == "device"
    assert backup_place(2 * GIB, False, 0, GIB).where == "none"


@pytest.mark.unit
def test_a_place_is_one_of_three():
    with pytest.raises(ValueError, match="one of"):
        BackupPlace("disk", "")


@pytest.mark.parametrize("rollback", [True, False])
def test_the_engine_reports_where_a_session_kept_its_copies(tmp_path, rollback):
    """A real engine (CPU): a full update backs up every weight beside them, and /weightstream/memory says where
    and how many bytes; without rollback it says none."""
    from safetensors.torch import load_file

    from weightstream.engines import ReferenceEngine
    from weightstream.models.presets import preset_config, save_random_checkpoint
    from weightstream.reference_engine.server import serve, stop
    from weightstream.streaming.bucket import Bucket

    start = save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path / "start", seed=5)
    new = save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path / "new", seed=6)
    named = sorted(load_file(f"{new}/model.safetensors").items())
    server = serve(start, 1, rollback=rollback)
    try:
        eng = ReferenceEngine(server.url)
        bucket = Bucket.pack(named)  # kept mapped until the engine has answered
        eng.begin_update("v1")
        eng.receive_ipc(0, [eng.encode_ipc(bucket)], None)
        assert eng.commit_update() == "v1"
        (memory,) = eng.get("/weightstream/memory")["ranks"]
    finally:
        stop(server)
    weights = sum(t.numel() * t.element_size() for _, t in named)
    if rollback:
        assert memory["backup_place"] == "device" and "kept beside the weights" in memory["backup_why"]
        assert memory["backup_bytes"] == weights
    else:
        assert (memory["backup_place"], memory["backup_bytes"]) == ("none", 0)
    assert memory["session_peak_extra_cuda_bytes"] is None  # no GPU here
