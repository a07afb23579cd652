"""The converter registry, keyed by HF ``model_type``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

from weightstream.converters.mapping import Converter
from weightstream.errors import UnknownModelError
from weightstream.models.spec import ModelSpec, load_hf_config

ConverterFactory = Callable[[], Converter]

_FACTORIES: dict[str, ConverterFactory] = {}
_BUILT: dict[str, Converter] = {}


@overload
def register_converter(model_type: str, converter: Converter, *, overwrite: bool = False) -> Converter: ...
@overload
def register_converter(
    model_type: str, converter: None = None, *, overwrite: bool = False
) -> Callable[[ConverterFactory], ConverterFactory]: ...


def register_converter(model_type, converter=None, *, overwrite=False):
    """Register a converter for an HF ``model_type``.

    Either pass a :class:`Converter` directly, or use it as a decorator on a function that
    returns one (built on first use)::

        @register_converter("my_model")
        def my_model() -> Converter:
            return QWEN3.derive("my_model", add=[...])

    Registering a taken key raises unless ``overwrite=True``.
    """

    _load_builtins()

    def add(factory: ConverterFactory) -> ConverterFactory:
        if model_type in _FACTORIES and not overwrite:
            raise ValueError(
                f"a converter for model_type {model_type!r} is already registered; "
                "pass overwrite=True to replace it"
            )
        _FACTORIES[model_type] = factory
        _BUILT.pop(model_type, None)
        return factory

    if converter is not None:
        if not isinstance(converter, Converter):
            raise TypeError(f"expected a Converter, got {type(converter).__name__}")
        add(lambda: converter)
        return converter
    return add


def get_converter(model_type: str) -> Converter:
    """The converter for ``model_type``; an unknown one raises, listing the known ones."""
    _load_builtins()
    if model_type not in _FACTORIES:
        raise UnknownModelError(model_type, _FACTORIES)
    if model_type not in _BUILT:
        conv = _FACTORIES[model_type]()
        if conv.model_type != model_type:
            raise ValueError(f"converter registered for {model_type!r} reports model_type {conv.model_type!r}")
        _BUILT[model_type] = conv
    return _BUILT[model_type]


def model_spec(config: Any) -> ModelSpec:
    """The :class:`ModelSpec` of an HF config (a transformers config, a dict with ``model_type``, or a
    directory), with the features its registered converter reads; an unknown model type raises."""
    cfg = load_hf_config(config)
    return ModelSpec.from_hf_config(cfg, get_converter(cfg.model_type).features)


def known_model_types() -> list[str]:
    _load_builtins()
    return sorted(_FACTORIES)


def unregister_converter(model_type: str) -> None:
    _FACTORIES.pop(model_type, None)
    _BUILT.pop(model_type, None)


_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        from weightstream.converters.deepseek_v3 import DEEPSEEK_V3
        from weightstream.converters.glm4_moe import GLM4_MOE
        from weightstream.converters.llama import LLAMA, MISTRAL
        from weightstream.converters.mixtral import MIXTRAL
        from weightstream.converters.qwen2 import QWEN2
        from weightstream.converters.qwen3 import QWEN3
        from weightstream.converters.qwen_moe import QWEN2_MOE, QWEN3_MOE

        for converter in (QWEN2, QWEN3, QWEN2_MOE, QWEN3_MOE, GLM4_MOE, DEEPSEEK_V3, LLAMA, MISTRAL, MIXTRAL):
            register_converter(converter.model_type, converter)
