"""weightstream: stream Megatron-Core weights into inference engines, in the Hugging Face layout.

The names below are imported on first use (``ws.WeightSync`` imports ``weightstream.update``): ``import
weightstream`` itself loads neither torch nor transformers, so that the ``weightstream`` command answers
``--help`` at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightstream._version import __version__
from weightstream.common.lazy import lazy_attribute

if TYPE_CHECKING:
    from weightstream.convert import ConvertReport, convert_checkpoint
    from weightstream.converters import Converter, Mapping, get_converter, known_model_types, register_converter
    from weightstream.engines import (
        EngineAdapter,
        EngineError,
        EngineInfo,
        LMDeployEngine,
        ReferenceEngine,
        SGLangEngine,
        VLLMEngine,
    )
    from weightstream.errors import ConversionError, UnknownModelError, UpdateError, WeightstreamError
    from weightstream.models.spec import ModelSpec
    from weightstream.sinks.safetensors import CheckpointReport, save_hf_checkpoint
    from weightstream.sources import Source
    from weightstream.sources.dtensor import DTensorSource
    from weightstream.sources.megatron_checkpoint import CheckpointFormatError, MegatronCheckpointSource
    from weightstream.streaming import (
        Bucket,
        BucketStream,
        Shard,
        TensorMeta,
        Topology,
        stream_hf_weights,
    )
    from weightstream.update import SyncOptions, UpdateReport, WeightSync, update_weights

# Each public name and the module it comes from, imported on first use.
_HOMES: dict[str, str] = {
    **dict.fromkeys(("ConvertReport", "convert_checkpoint"), "weightstream.convert"),
    **dict.fromkeys(("Converter", "Mapping", "get_converter", "known_model_types", "register_converter"),
                    "weightstream.converters"),
    **dict.fromkeys(("EngineAdapter", "EngineError", "EngineInfo", "LMDeployEngine", "ReferenceEngine",
                     "SGLangEngine", "VLLMEngine"), "weightstream.engines"),
    **dict.fromkeys(("ConversionError", "UnknownModelError", "UpdateError", "WeightstreamError"),
                    "weightstream.errors"),
    "ModelSpec": "weightstream.models.spec",
    **dict.fromkeys(("CheckpointReport", "save_hf_checkpoint"), "weightstream.sinks.safetensors"),
    "Source": "weightstream.sources",
    "DTensorSource": "weightstream.sources.dtensor",
    **dict.fromkeys(("CheckpointFormatError", "MegatronCheckpointSource"), "weightstream.sources.megatron_checkpoint"),
    **dict.fromkeys(("Bucket", "BucketStream", "Shard", "TensorMeta", "Topology", "stream_hf_weights"),
                    "weightstream.streaming"),
    **dict.fromkeys(("SyncOptions", "UpdateReport", "WeightSync", "update_weights"), "weightstream.update"),
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept here after."""
    return lazy_attribute(__name__, _HOMES, globals(), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__all__ = [
    "__version__",
    "Bucket", "BucketStream", "ConversionError", "Converter", "Mapping", "ModelSpec", "Shard", "TensorMeta",
    "Topology", "UnknownModelError", "WeightstreamError", "get_converter", "known_model_types",
    "register_converter", "save_hf_checkpoint", "stream_hf_weights",
    "EngineAdapter", "EngineError", "EngineInfo", "LMDeployEngine", "ReferenceEngine", "SGLangEngine", "UpdateError",
    "VLLMEngine", "UpdateReport",
    "SyncOptions", "WeightSync", "update_weights",
    "CheckpointFormatError", "CheckpointReport", "ConvertReport", "DTensorSource", "MegatronCheckpointSource", "Source",
    "convert_checkpoint",
]
