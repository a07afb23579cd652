"""What a model is: specs from HF configs, presets, Megatron-Core model building and loading."""

from weightstream.models.presets import PRESETS, preset_config, random_hf_model, save_random_checkpoint
from weightstream.models.spec import ModelSpec, load_hf_config

__all__ = ["PRESETS", "ModelSpec", "load_hf_config", "preset_config", "random_hf_model", "save_random_checkpoint"]
