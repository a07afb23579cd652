"""Hugging Face safetensors checkpoints on disk: a lazy reader, the index format, and the files beside the weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from typing_extensions import Self

from weightstream.errors import WeightstreamError

__all__ = [
    "INDEX_NAME", "SINGLE_NAME", "WEIGHT_SUFFIXES", "shard_name", "is_weight_file", "non_weight_files",
    "HFCheckpointError", "NoWeightsError", "CheckpointReader"
]


INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


# What a model directory holds that is weights (or their index), in any of the formats checkpoints are published in.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def is_weight_file(name: str) -> bool:
    """Whether a file of a model directory holds weights or indexes them (``*.safetensors``, ``*.bin``, ...,
    ``*.index.json``)."""
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


def non_weight_files(directory: str | os.PathLike) -> list[Path]:
    """The files of a model directory that go beside its weights when it is written anew: tokenizer files,
    ``generation_config.json``, chat templates, ``special_tokens_map.json``, the ``*.py`` of a ``trust_remote_code``
    model, ...; not ``config.json`` (written anew), not weights or indexes, not hidden files, not sub-directories.
    A link counts as the file it points to (as in the Hugging Face cache). Sorted by name."""
    found = []
    for path in sorted(Path(directory).iterdir()):
        name = path.name
        if name == "config.json" or name.startswith(".") or is_weight_file(name) or not path.is_file():
            continue
        found.append(path)
    return found


class HFCheckpointError(WeightstreamError):
    """An HF checkpoint directory that cannot be read: each file, and what is wrong with it."""


class NoWeightsError(HFCheckpointError, FileNotFoundError):
    """A directory with neither an index nor a single safetensors file (a model directory without weights)."""


class CheckpointReader:
    """Reads tensors of an HF checkpoint directory one at a time (sharded with an index, or one file).

    Every file is opened (its header parsed) here, so a missing, truncated or damaged file, or an index naming
    tensors a file does not hold, fails at once: one :class:`HFCheckpointError` listing every such file."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._handles: dict[str, Any] = {}
        self.weight_map: dict[str, str] = self._weight_map()
        problems = [p for file in sorted(set(self.weight_map.values())) if (p := self._open_problem(file))]
        if problems:
            self.close()
            raise HFCheckpointError(f"the checkpoint {self.directory} cannot be read: " + "; ".join(problems))

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise HFCheckpointError(f"{index} is not a safetensors index: {type(exc).__name__}: {exc}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise HFCheckpointError(f"{index}: weight_map is not an object of tensor name -> file name")
            return dict(weight_map)
        if (self.directory / SINGLE_NAME).exists():
            try:
                names = self._handle(SINGLE_NAME).keys()
            except HFCheckpointError as exc:
                raise HFCheckpointError(f"the checkpoint {self.directory} cannot be read: {exc}") from None
            return dict.fromkeys(names, SINGLE_NAME)
        raise NoWeightsError(f"{self.directory} holds neither {INDEX_NAME} nor {SINGLE_NAME}")

    def _open_problem(self, file: str) -> str | None:
        """What is wrong with one file of the checkpoint, or None."""
        if Path(file).name != file:
            return f"{file} is outside the directory"
        if not (self.directory / file).is_file():
            return f"{file} is missing"
        try:
            held = set(self._handle(file).keys())
        except HFCheckpointError as exc:
            return str(exc)
        absent = sorted(name for name, f in self.weight_map.items() if f == file and name not in held)
        if absent:
            return f"{file} lacks {len(absent)} tensor(s) the index puts there: " + ", ".join(absent)
        return None

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(self.directory / file, framework="pt")
            except (SafetensorError, OSError) as exc:
                raise HFCheckpointError(f"{self.directory / file}: {exc}") from None
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle(self.weight_map[name]).get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise HFCheckpointError(f"{self.directory / self.weight_map[name]}: {name}: {exc}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.weight_map[name]).get_slice(name).get_shape())

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.weight_map:
            yield name, self.get(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
