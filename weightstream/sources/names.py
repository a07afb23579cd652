"""Megatron-Core's parameter names: the one place that reads layer and expert indices out of them.

A chunk names its layers from 0 (``decoder.layers.<i>.``); the model's global layer is the chunk's offset
plus ``i``. A rank's local experts are numbered from 0 in one of two forms, by the MLP class that holds
them: ``SequentialMLP`` (``mlp.experts.local_experts.<e>.linear_fc1.weight``) and ``TEGroupedMLP``
(``mlp.experts.linear_fc1.weight<e>``); the global expert is ``ep_rank * experts_per_rank + e``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "LAYERS_PREFIX", "WEIGHT_BUFFERS", "layer_index", "expert_index", "layer_count", "expert_count", "stacked_layers",
    "stacked_experts", "unstacked_name", "global_name", "order_key"
]


LAYERS_PREFIX = "decoder.layers."
# A distributed (torch_dist) checkpoint may stack layers on a leading axis (``decoder.layers.<rest>``, no index)
# and a layer's routed experts on an axis of their own (``mlp.experts.experts.<rest>``).
_STACKED_EXPERTS = ".mlp.experts.experts."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_SEQUENTIAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")

# Buffers that are part of the weights (not parameters, yet engines need them), by their name's end.
WEIGHT_BUFFERS = ("router.expert_bias",)


def layer_index(name: str) -> int | None:
    """The layer a name belongs to (``decoder.layers.<i>.``), None outside the decoder's layers."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _expert_match(name: str) -> re.Match[str] | None:
    return _SEQUENTIAL_EXPERT.search(name) or _GROUPED_EXPERT.search(name)


def expert_index(name: str) -> int | None:
    """The expert a name belongs to (either form), None for a name of no expert."""
    m = _expert_match(name)
    return int(m.group(2)) if m else None


def layer_count(names: Iterable[str]) -> int:
    """How many layers these names hold (a chunk's state dict)."""
    return len({i for n in names if (i := layer_index(n)) is not None})


def expert_count(names: Iterable[str]) -> int:
    """How many local experts these names hold (a rank's state dict)."""
    return len({e for n in names if (e := expert_index(n)) is not None})


def stacked_layers(name: str) -> bool:
    """A name under the decoder's layers that holds no layer index: layers stacked in one tensor."""
    return name.startswith(LAYERS_PREFIX) and layer_index(name) is None


def stacked_experts(name: str) -> bool:
    """A name of a layer's routed experts stacked on an axis (a distributed checkpoint)."""
    return _STACKED_EXPERTS in name


def unstacked_name(name: str, layer: int | None, expert: int | None) -> str:
    """The name of one layer's (and one expert's) slice of a stacked tensor, as a model chunk names it."""
    if layer is not None:
        name = f"{LAYERS_PREFIX}{layer}." + name[len(LAYERS_PREFIX):]
    if expert is not None:
        name = name.replace(_STACKED_EXPERTS, f".mlp.experts.local_experts.{expert}.")
    return name


def global_name(name: str, layer_map: dict[int, int], ep_rank: int, experts_per_rank: int) -> tuple[str, bool]:
    """A chunk's local name as the model's global one (layers by ``layer_map``, experts by EP rank), and
    whether it is an expert's."""
    m = _LAYER.match(name)
    if m:
        local = int(m.group(1))
        if local not in layer_map:
            raise ValueError(f"{name}: layer {local} is not in the chunk's decoder")
        name = f"{LAYERS_PREFIX}{layer_map[local]}." + name[m.end():]
    e = _expert_match(name)
    if e is None:
        return name, False
    index = int(e.group(2)) + ep_rank * experts_per_rank
    return name[: e.start(2)] + str(index) + name[e.end(2):], True


def order_key(name: str, position: int) -> tuple[int, int, int, int]:
    """Where a name goes in the global table: embeddings, then layer by layer (expert by expert within a
    layer), then the rest; ``position`` keeps the order otherwise."""
    layer = layer_index(name)
    if layer is None:
        return (0 if name.startswith("embedding") else 2, 0, 0, position)
    expert = expert_index(name)
    return (1, layer, -1 if expert is None else expert, position)
