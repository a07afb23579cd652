"""Bounded JSON-over-HTTP calls to one engine: what every HTTP adapter (SGLang, vLLM, LMDeploy, the reference
engine) builds on."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from weightstream.engines.base import EngineError, EngineInfo, EngineUnreachable
from weightstream.engines.formats import stated_format
from weightstream.wire.fp8 import BlockFP8

__all__ = ["HTTPEngine"]


class HTTPEngine:
    """Bounded JSON-over-HTTP calls to one engine; the plumbing every HTTP adapter shares."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                 group_name: str = "weight_update_group", fp8: BlockFP8 | None = None,
                 model_path: str | Path | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.group_name = group_name
        # The layout of the served model as the user states it (``fp8=``, or the ``quantization_config`` of
        # ``model_path``'s config.json): what an engine that does not report its layout serves.
        self.stated = stated_format(fp8, model_path)
        self._info: EngineInfo | None = None
        self._server_info: dict | None = None  # what the engine said it is (each adapter asks in its own way)
        self._session = False  # a session this client opened and has not ended
        self._version: str | None = None  # the weight version of that session

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def request(self, method: str, path: str, body: Any = None, *, step: str | None = None,
                timeout_s: float | None = None) -> Any:
        step = step or path.strip("/")
        timeout = timeout_s or self.timeout_s
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                parsed = json.loads(detail)
                detail = parsed.get("message") or (parsed.get("error") or {}).get("message") or detail
            except (ValueError, AttributeError):
                pass
            raise EngineError(self.url, step, f"HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise EngineUnreachable(self.url, step,
                                    f"unreachable or no answer within {timeout:.0f} s ({reason})") from None
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = raw.decode(errors="replace")
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(self.url, step, reply.get("message", "success=false"))
        return reply

    def info(self, refresh: bool = False) -> EngineInfo:
        """What the engine is (each engine's adapter asks it in its own way)."""
        raise NotImplementedError

    def post(self, path: str, body: Any = None, **kw) -> Any:
        return self.request("POST", path, body if body is not None else {}, **kw)

    def get(self, path: str, **kw) -> Any:
        return self.request("GET", path, **kw)

    @property
    def tp_size(self) -> int:
        return self.info().tp_size
