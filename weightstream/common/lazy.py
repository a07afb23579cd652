"""Names of a package imported from their modules on first use (a package's ``__getattr__``), so that importing the
package costs nothing of what its names need (torch, transformers, Megatron-Core)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

__all__ = ["lazy_attribute"]


def lazy_attribute(package: str, homes: Mapping[str, str], namespace: dict[str, Any], name: str) -> Any:
    """``name`` of ``package``, imported from its module (``homes[name]``) and kept in ``namespace`` (the package's
    globals) after; an AttributeError for a name the package does not have."""
    home = homes.get(name)
    if home is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    namespace[name] = value
    return value
