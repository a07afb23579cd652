"""weightstream.checks.compare: every difference of two checkpoints listed, of every kind, in a frozen record; a
tolerance that cannot be, and directories that cannot be read, refused in one error."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from weightstream.checks.compare import Comparison, compare_checkpoints
from weightstream.common.hf_files import HFCheckpointError, NoWeightsError

pytestmark = pytest.mark.unit


def _save(directory, tensors: dict[str, torch.Tensor]) -> str:
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def test_every_difference_is_listed_by_kind(tmp_path):
    base = {f"t{i}": torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i in range(4)}
    other = dict(base)
    del other["t0"]
    other["u"] = torch.zeros(1)
    other["t1"] = base["t1"][:1].clone()
    other["t2"] = base["t2"].to(torch.bfloat16)
    other["t3"] = base["t3"].clone()
    other["t3"][1, 2] += 0.5
    a, b = _save(tmp_path / "a", base), _save(tmp_path / "b", other)

    assert compare_checkpoints(a, b) == Comparison(
        missing=("t0",), extra=("u",), shape=("t1: (2, 3) vs (1, 3)",),
        dtype=("t2: torch.float32 vs torch.bfloat16",), differ=("t3: max abs difference 0.5",), compared=1, bytes=24)
    assert compare_checkpoints(a, b, atol=1.0) == Comparison(
        missing=("t0",), extra=("u",), shape=("t1: (2, 3) vs (1, 3)",),
        dtype_notes=("t2: torch.float32 vs torch.bfloat16",), compared=2, bytes=48)
    same = compare_checkpoints(a, a)
    assert (same.ok, same.compared, same.bytes) == (True, 4, 96)
    with pytest.raises(dataclasses.FrozenInstanceError):
        same.compared = 0  # type: ignore[misc]


def test_a_tolerance_below_zero_or_nan_is_refused(tmp_path):
    a = _save(tmp_path / "a", {"t": torch.zeros(2)})
    for atol in (-1e-3, float("nan")):
        with pytest.raises(ValueError, match="atol must be 0 or more, got"):
            compare_checkpoints(a, a, atol=atol)


def test_directories_that_cannot_be_read_are_named_in_one_error(tmp_path):
    a = _save(tmp_path / "a", {"t": torch.zeros(2)})
    (tmp_path / "empty").mkdir()
    damaged = _save(tmp_path / "damaged", {"t": torch.zeros(1000)})
    with open(f"{damaged}/model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(NoWeightsError, match="empty"):  # one: its own error, as it was raised
        compare_checkpoints(a, tmp_path / "empty")
    with pytest.raises(HFCheckpointError) as err:
        compare_checkpoints(tmp_path / "empty", damaged)
    assert str(tmp_path / "empty") in str(err.value) and f"{damaged} cannot be read" in str(err.value)
