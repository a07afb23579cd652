"""What a model is, from its HF config: its spec (ModelSpec) and the presets (tiny and real sizes)."""

from weightstream.models.presets import PRESETS, preset_config, random_hf_model, save_random_checkpoint
from weightstream.models.spec import ModelSpec, load_hf_config

__all__ = ["PRESETS", "ModelSpec", "load_hf_config", "preset_config", "random_hf_model", "save_random_checkpoint"]
