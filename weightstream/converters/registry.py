"""The converter registry, keyed by HF ``model_type``.

It holds the built-in families, then, on first use in each process, the converters of plugins: every
``weightstream.converters`` entry point of the installed distributions, and the modules named in
``$WEIGHTSTREAM_PLUGINS`` (comma-separated; the command line's ``--plugin`` sets it, so that the processes a command
starts load them too). A plugin is a module whose import registers its converters (``register_converter``), or,
as an entry point, a function of no arguments that does.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any, overload

from weightstream.converters.mapping import Converter
from weightstream.errors import UnknownModelError, WeightstreamError
from weightstream.models.spec import ModelSpec, load_hf_config

__all__ = [
    "PLUGINS_ENV", "ENTRY_POINT_GROUP", "PluginError", "ConverterFactory", "register_converter", "get_converter",
    "model_spec", "known_model_types", "unregister_converter", "load_plugins"
]


PLUGINS_ENV = "WEIGHTSTREAM_PLUGINS"
ENTRY_POINT_GROUP = "weightstream.converters"


class PluginError(WeightstreamError):
    """Plugins that could not be loaded: each, and why."""

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


def load_plugins(modules: Iterable[str], *, search: str | None = None) -> list[str]:
    """Import the plugin ``modules`` (names; comma-separated lists too), whose imports register converters, and
    add them to ``$WEIGHTSTREAM_PLUGINS`` for the processes this one starts. ``search``: a directory put first on
    ``sys.path`` (the command line's working directory, as ``python -m`` has it). One :class:`PluginError` lists
    every module that fails to import. Returns the modules now named in the variable."""
    if search is not None and search not in sys.path:
        sys.path.insert(0, search)
    _load_builtins()
    names = _split(modules)
    problems = [p for name in names if (p := _import_problem(name))]
    if problems:
        raise PluginError("cannot load plugin(s): " + "; ".join(problems))
    named = list(dict.fromkeys(_split([os.environ.get(PLUGINS_ENV, "")]) + names))
    if named:
        os.environ[PLUGINS_ENV] = ",".join(named)
    return named


def _split(items: Iterable[str]) -> list[str]:
    return [name.strip() for item in items for name in item.split(",") if name.strip()]


def _import_problem(module: str) -> str | None:
    """Why ``module`` could not be imported, or None once it is."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 — a plugin's own failure, reported with the others
        return f"{module}: {type(exc).__name__}: {exc}"
    return None


def _entry_point_problem(entry_point: Any) -> str | None:
    """Why a ``weightstream.converters`` entry point could not be loaded, or None once it is (a module imported,
    or a function called)."""
    where = f"entry point {entry_point.name} = {entry_point.value}"
    try:
        target = entry_point.load()
        if isinstance(target, types.ModuleType):
            return None
        if not callable(target):
            return f"{where}: names neither a module nor a function"
        target()
    except Exception as exc:  # noqa: BLE001 — a plugin's own failure, reported with the others
        return f"{where}: {type(exc).__name__}: {exc}"
    return None


def _load_installed_plugins() -> None:
    """The entry points of every installed distribution, then the modules ``$WEIGHTSTREAM_PLUGINS`` names."""
    from importlib.metadata import entry_points

    problems = [p for ep in entry_points(group=ENTRY_POINT_GROUP) if (p := _entry_point_problem(ep))]
    problems += [p for name in _split([os.environ.get(PLUGINS_ENV, "")]) if (p := _import_problem(name))]
    if problems:
        raise PluginError("cannot load plugin(s): " + "; ".join(problems))


_builtins_loaded = False


def _load_builtins() -> None:
    """The built-in families, then the installed plugins (once per process)."""
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
        _load_installed_plugins()
