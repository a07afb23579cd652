"""What a model is, from its HF config: its spec (ModelSpec) and the presets (tiny and real sizes).

The names are imported on first use: the preset table (``weightstream.models.presets.PRESETS``) is read
without torch or transformers (``weightstream presets``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightstream.common.lazy import lazy_attribute

if TYPE_CHECKING:
    from weightstream.models.presets import PRESETS, preset_config, random_hf_model, save_random_checkpoint
    from weightstream.models.spec import ModelSpec, load_hf_config

_HOMES = {
    **dict.fromkeys(("PRESETS", "preset_config", "random_hf_model", "save_random_checkpoint"),
                    "weightstream.models.presets"),
    **dict.fromkeys(("ModelSpec", "load_hf_config"), "weightstream.models.spec"),
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _HOMES, globals(), name)


__all__ = ["PRESETS", "ModelSpec", "load_hf_config", "preset_config", "random_hf_model", "save_random_checkpoint"]
