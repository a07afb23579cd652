"""Megatron <-> HF per model family: pure ops, declarative mappings, a registry."""

from weightstream.converters.mapping import Converter, Mapping, Resolved, tied, untied
from weightstream.converters.ops import (
    GATED,
    IDENTITY,
    QKV,
    VOCAB,
    NotRepresentable,
    OpContext,
    TensorOp,
    Unrepresentable,
)
from weightstream.converters.registry import (
    get_converter,
    known_model_types,
    model_spec,
    register_converter,
    unregister_converter,
)

__all__ = [
    "Converter", "Mapping", "Resolved", "tied", "untied",
    "GATED", "IDENTITY", "QKV", "VOCAB", "NotRepresentable", "OpContext", "TensorOp", "Unrepresentable",
    "get_converter", "known_model_types", "model_spec", "register_converter", "unregister_converter",
]
