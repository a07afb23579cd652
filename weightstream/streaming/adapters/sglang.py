"""SGLang's HTTP weight-update protocol, as a client (also spoken by ``weightstream engine``).

Every call has a bound (``timeout_s``); a failure raises :class:`EngineError` naming the engine and
the step. Endpoint names and payload fields live here and nowhere else.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weightstream.errors import WeightstreamError
from weightstream.models.spec import dtype_name
from weightstream.streaming.bucket import Bucket


class EngineError(WeightstreamError):
    def __init__(self, url: str, step: str, detail: str):
        self.url, self.step, self.detail = url, step, detail
        super().__init__(f"engine {url}: {step} failed: {detail}")

    def __reduce__(self):
        return (type(self), (self.url, self.step, self.detail))


@dataclass
class SGLangEngine:
    """One engine (all its TP ranks) behind one HTTP address."""

    url: str
    api_key: str | None = None
    timeout_s: float = 60.0
    group_name: str = "weight_update_group"

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self._info: dict | None = None
        self._session = False  # a session this client opened and has not ended

    # -- transport-agnostic plumbing ---------------------------------------------------------

    def request(self, method: str, path: str, body: dict | None = None, *, step: str | None = None,
                timeout_s: float | None = None) -> Any:
        step = step or path.strip("/")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("message", detail)
            except (ValueError, AttributeError):
                pass
            raise EngineError(self.url, step, f"HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EngineError(self.url, step, f"unreachable or no answer within {timeout_s or self.timeout_s:.0f} s ({reason})") from None
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = raw.decode(errors="replace")
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(self.url, step, reply.get("message", "success=false"))
        return reply

    def post(self, path: str, body: dict | None = None, **kw) -> Any:
        return self.request("POST", path, body if body is not None else {}, **kw)

    # -- what the engine is ------------------------------------------------------------------

    def server_info(self, refresh: bool = False) -> dict:
        if self._info is None or refresh:
            self._info = self.request("GET", "/get_server_info", step="get_server_info")
        return self._info

    @property
    def tp_size(self) -> int:
        return int(self.server_info().get("tp_size", 1))

    @property
    def pp_size(self) -> int:
        return int(self.server_info().get("pp_size", 1))

    def supports_p2p(self) -> bool:
        return bool(self.server_info().get("weightstream_p2p", False))

    def weight_version(self) -> str:
        return str(self.request("GET", "/model_info", step="model_info").get("weight_version"))

    # -- SGLang's protocol ----------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> None:
        self.post("/pause_generation", {"mode": mode}, step="pause_generation")

    def resume(self, timeout_s: float | None = None) -> None:
        self.post("/continue_generation", {}, step="continue_generation", timeout_s=timeout_s)

    def begin_update(self, timeout_s: float | None = None) -> None:
        """Open a versioned update session. ``timeout_s``: how long the engine may wait for this
        trainer between two steps before it gives the session up by itself."""
        self.post("/begin_weight_update", {"timeout_s": timeout_s} if timeout_s else {}, step="begin_weight_update")
        self._session = True

    def end_update(self) -> None:
        self._session = False
        self.post("/end_weight_update", {}, step="end_weight_update")

    def abort_update(self, timeout_s: float | None = None) -> None:
        """Close the session without committing: an engine that can roll back returns to the weights of
        its last committed update; one that cannot (SGLang) ends the session as it stands."""
        if not self._session:
            return  # none was opened (or it was already ended, which rolls a failed session back)
        self._session = False
        if (self._info or {}).get("weightstream_abort"):
            self.post("/weightstream/abort_weight_update", {}, step="abort_weight_update", timeout_s=timeout_s)
        else:
            self.post("/end_weight_update", {}, step="end_weight_update", timeout_s=timeout_s)

    def flush_cache(self) -> None:
        self.post("/flush_cache", {}, step="flush_cache")

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int, backend: str,
                   timeout_s: float) -> None:
        self.post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": self.group_name, "backend": backend, "timeout_s": timeout_s,
        }, step="init_weights_update_group", timeout_s=timeout_s + 2.0)  # the engine gives up at timeout_s

    def destroy_group(self, timeout_s: float | None = None) -> None:
        self.post("/destroy_weights_update_group", {"group_name": self.group_name},
                  step="destroy_weights_update_group", timeout_s=timeout_s)

    def update_from_distributed(self, bucket: Bucket, *, weight_version: str | None, checksum: str | None,
                                flush_cache: bool = False) -> None:
        """The metadata of one dense (back-to-back) bucket whose buffer is being broadcast."""
        self.post("/update_weights_from_distributed", {
            "names": [m.name for m in bucket.metas], "dtypes": [dtype_name(m.dtype) for m in bucket.metas],
            "shapes": [list(m.shape) for m in bucket.metas], "group_name": self.group_name,
            "flush_cache": flush_cache, "load_format": "flattened_bucket", "weight_version": weight_version,
            "weightstream_checksum": checksum,
        }, step=f"update_weights_from_distributed (bucket {bucket.index})")

    def update_from_tensor(self, payloads: Sequence[str], *, index: int, weight_version: str | None,
                           checksums: Sequence[str | None] | None, flush_cache: bool = False) -> None:
        self.post("/update_weights_from_tensor", {
            "serialized_named_tensors": list(payloads), "load_format": "flattened_bucket",
            "flush_cache": flush_cache, "weight_version": weight_version,
            "weightstream_checksums": list(checksums) if checksums else None,
        }, step=f"update_weights_from_tensor (bucket {index})")

    def update_from_p2p(self, ranks: list[dict], *, index: int, weight_version: str | None) -> None:
        """weightstream's per-rank extension: metadata of what each engine rank receives by send/recv."""
        self.post("/weightstream/update_weights_from_p2p", {
            "group_name": self.group_name, "ranks": ranks, "weight_version": weight_version,
        }, step=f"update_weights_from_p2p (bucket {index})")

    def logits(self, input_ids: list[list[int]]):
        import base64

        import numpy as np
        import torch

        reply = self.post("/weightstream/logits", {"input_ids": input_ids}, step="logits")
        arr = np.frombuffer(base64.b64decode(reply["logits_b64"]), dtype=np.float32).reshape(reply["shape"])
        return torch.from_numpy(arr.copy())

    def generate(self, input_ids: list[int], max_new_tokens: int = 8) -> dict:
        return self.post("/generate", {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens}},
                         step="generate")
