"""Hugging Face safetensors checkpoints on disk: a lazy reader and the index format."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


class CheckpointReader:
    """Reads tensors of an HF checkpoint directory one at a time (sharded with an index, or one file)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.directory / SINGLE_NAME).exists():
            with safe_open(self.directory / SINGLE_NAME, framework="pt") as f:
                weight_map = {k: SINGLE_NAME for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.directory} holds neither {INDEX_NAME} nor {SINGLE_NAME}")
        self.weight_map: dict[str, str] = dict(weight_map)
        self._handles: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(self.directory / file, framework="pt")
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.weight_map[name]).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.weight_map[name]).get_slice(name).get_shape())

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.weight_map:
            yield name, self.get(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
