"""Where a stream's tensors come from: a live Megatron-Core model, an FSDP2/DTensor model, a Megatron
checkpoint on disk (see :mod:`weightstream.sources.base`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from weightstream.sources.base import Source
from weightstream.sources.dtensor import DTensorSource, is_hf_module
from weightstream.sources.megatron import MegatronSource, as_chunks, unwrap
from weightstream.sources.topology import Topology


def as_source(model: Any, topology: Topology | None = None) -> Source:
    """The source for what a user passed: a :class:`Source` as is; a transformers model (or an ``nn.Module``
    with HF names) with DTensor or plain parameters -> DTensorSource; otherwise Megatron-Core chunks."""
    # (ours first: the Protocol's own isinstance inspects each of its members, 50 us a call)
    if isinstance(model, (MegatronSource, DTensorSource)) or (
            not isinstance(model, (nn.Module, list, tuple)) and isinstance(model, Source)):
        if topology is not None:
            raise ValueError("topology= applies to Megatron-Core model chunks, not to a source")
        return model
    chunks = as_chunks(model)
    if len(chunks) == 1 and is_hf_module(unwrap(chunks[0])):
        if topology is not None:
            raise ValueError("topology= applies to Megatron-Core model chunks; a DTensor model carries its own mesh")
        return DTensorSource(unwrap(chunks[0]))
    return MegatronSource(chunks, topology or Topology.current())


__all__ = ["DTensorSource", "MegatronSource", "Source", "Topology", "as_source"]
