"""The rank's own parameters, under global names.

This is the only module that knows Megatron-Core's module tree: it unwraps DDP/Float16Module,
renames each VPP chunk's local layer indices to global ones (``layer_number - 1``) and each EP
rank's local expert indices to global ones (``ep_rank * experts_per_rank + e``), and picks up the
buffers that are weights (``router.expert_bias``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from weightstream.streaming.topology import Topology

# Buffers that are part of the weights (not parameters, yet engines need them).
WEIGHT_BUFFERS = ("router.expert_bias",)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_SEQUENTIAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


def unwrap(module: nn.Module) -> nn.Module:
    """Strip DDP / Float16Module / FSDP-style wrappers (anything exposing ``.module``)."""
    while hasattr(module, "module") and isinstance(module.module, nn.Module):
        module = module.module
    return module


def as_chunks(model_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(model_chunks, nn.Module):
        return [model_chunks]
    chunks = list(model_chunks)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise TypeError("model_chunks must be a torch.nn.Module or a non-empty list of them (VPP chunks)")
    return chunks


@dataclass(frozen=True, slots=True)
class LocalTensor:
    name: str  # global Megatron name
    tensor: Tensor
    expert: bool  # split over expert parallel ranks


def _layer_offsets(model: nn.Module) -> dict[int, int]:
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None:
        return {}
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


def _experts_per_rank(model: nn.Module, num_experts: int, ep_size: int) -> int:
    if num_experts and num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split over {ep_size} expert-parallel ranks")
    return num_experts // ep_size if num_experts else 0


def global_name(name: str, layer_map: dict[int, int], ep_rank: int, experts_per_rank: int) -> tuple[str, bool]:
    m = _LAYER.match(name)
    if m:
        local = int(m.group(1))
        if local not in layer_map:
            raise ValueError(f"{name}: layer {local} is not in the chunk's decoder")
        name = f"decoder.layers.{layer_map[local]}." + name[m.end() :]
    expert = False
    for pattern in (_SEQUENTIAL_EXPERT, _GROUPED_EXPERT):
        m = pattern.search(name)
        if m:
            expert = True
            e = int(m.group(2)) + ep_rank * experts_per_rank
            name = name[: m.start(2)] + str(e) + name[m.end(2) :]
            break
    return name, expert


def local_tensors(
    model_chunks: nn.Module | Sequence[nn.Module], topo: Topology, num_experts: int = 0
) -> list[LocalTensor]:
    """Every parameter (and weight buffer) this rank holds, in module order, under global names."""
    out: list[LocalTensor] = []
    seen: dict[str, int] = {}
    for chunk in as_chunks(model_chunks):
        model = unwrap(chunk)
        layer_map = _layer_offsets(model)
        per_rank = _experts_per_rank(model, num_experts, topo.ep_size)
        named: Iterable[tuple[str, Tensor]] = list(model.named_parameters())
        named += [(n, b) for n, b in model.named_buffers() if n.endswith(WEIGHT_BUFFERS)]
        for name, tensor in named:
            gname, expert = global_name(name, layer_map, topo.ep_rank, per_rank)
            if gname in seen:
                raise ValueError(f"two local tensors map to the same global name {gname!r} (chunks overlap?)")
            seen[gname] = len(out)
            out.append(LocalTensor(gname, tensor.detach(), expert))
    return out
