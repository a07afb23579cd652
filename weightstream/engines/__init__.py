"""Engine adapters: one module per engine, each speaking its engine's weight-update protocol behind
:class:`~weightstream.engines.base.EngineAdapter`."""

from __future__ import annotations

from typing import Any

from weightstream.engines.base import EngineAdapter, EngineError, EngineInfo, GroupSpec, RankBucket
from weightstream.engines.http import HTTPEngine
from weightstream.engines.lmdeploy import LMDeployEngine
from weightstream.engines.reference import ENGINE_NAME, ReferenceEngine
from weightstream.engines.sglang import SGLangEngine
from weightstream.engines.vllm import VLLMEngine

ADAPTERS: dict[str, type] = {
    "sglang": SGLangEngine, "reference": ReferenceEngine, "vllm": VLLMEngine, "lmdeploy": LMDeployEngine,
}


def register_adapter(name: str, cls: type, *, overwrite: bool = False) -> None:
    """Make ``engine=name`` (and detection by :func:`detect`) know another engine's adapter class."""
    if name in ADAPTERS and not overwrite:
        raise ValueError(f"an engine adapter named {name!r} is already registered (pass overwrite=True)")
    ADAPTERS[name] = cls


def detect(url: str, *, api_key: str | None = None, timeout_s: float = 60.0) -> str:
    """Which adapter speaks to the engine at ``url``, from what it answers."""
    probe = HTTPEngine(url, api_key=api_key, timeout_s=timeout_s)
    try:
        reply = probe.get("/get_server_info", step="get_server_info (detecting the engine)")
    except EngineError as exc:
        if "HTTP 404" not in exc.detail:
            raise
        # Neither LMDeploy nor vLLM serves /get_server_info. LMDeploy always serves /distserve/engine_info;
        # /get_world_size is one of vLLM's dev-mode routes.
        try:
            probe.get("/distserve/engine_info", step="distserve/engine_info (detecting LMDeploy)")
            return "lmdeploy"
        except EngineError as exc2:
            if "HTTP 404" not in exc2.detail:
                raise
        probe.get("/get_world_size", step="get_world_size (detecting vLLM; is VLLM_SERVER_DEV_MODE=1 set?)")
        return "vllm"
    if isinstance(reply, dict) and reply.get("engine") == ENGINE_NAME:
        return "reference"
    if isinstance(reply, dict) and "tp_size" in reply:
        return "sglang"
    raise EngineError(url, "detecting the engine", f"its /get_server_info reply is none of {sorted(ADAPTERS)}'")


def make_adapter(engine: str, url: str, **options: Any) -> EngineAdapter:
    try:
        cls = ADAPTERS[engine]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(sorted(ADAPTERS))}") from None
    return cls(url, **options)


__all__ = [
    "ADAPTERS", "EngineAdapter", "EngineError", "EngineInfo", "GroupSpec", "LMDeployEngine", "RankBucket",
    "ReferenceEngine",
    "SGLangEngine", "VLLMEngine", "detect", "make_adapter", "register_adapter",
]
