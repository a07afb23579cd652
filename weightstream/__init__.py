"""weightstream: stream Megatron-Core weights into inference engines, in the Hugging Face layout."""

from weightstream._version import __version__
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
from weightstream.update import UpdateReport, WeightSync, update_weights

__all__ = [
    "__version__",
    "Bucket", "BucketStream", "ConversionError", "Converter", "Mapping", "ModelSpec", "Shard", "TensorMeta",
    "Topology", "UnknownModelError", "WeightstreamError", "get_converter", "known_model_types",
    "register_converter", "save_hf_checkpoint", "stream_hf_weights",
    "EngineAdapter", "EngineError", "EngineInfo", "LMDeployEngine", "ReferenceEngine", "SGLangEngine", "UpdateError",
    "VLLMEngine", "UpdateReport",
    "WeightSync", "update_weights",
    "CheckpointFormatError", "CheckpointReport", "ConvertReport", "DTensorSource", "MegatronCheckpointSource", "Source",
    "convert_checkpoint",
]
