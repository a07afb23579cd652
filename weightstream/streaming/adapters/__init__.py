"""Engine adapters: endpoints and payloads of each engine's weight-update protocol."""

from weightstream.streaming.adapters.sglang import EngineError, SGLangEngine

__all__ = ["EngineError", "SGLangEngine"]
