"""LMDeploy's HTTP weight-update protocol (0.18.0, PyTorch backend; request classes in
``lmdeploy/serve/openai/protocol.py``, routes in ``serve/openai/endpoints/management.py``, the receiving
code in ``pytorch/engine/model_agent/agent.py``; see ``docs/engines.md``). Endpoint names and payload fields
live here and nowhere else.

What is particular to LMDeploy:

- its flattened bucket holds one dtype and counts offsets in elements, so this adapter declares
  :data:`SINGLE_DTYPE` and the planner cuts buckets by dtype;
- a bucket is loaded as it arrives, and the post-load processing runs on the request that carries
  ``finished=True``: :meth:`LMDeployEngine.commit_update` sends an empty one (no tensors) on the route the
  update used;
- it keeps no weight version and cannot roll back; it sleeps (``level`` 1: weights offloaded, KV cache
  freed; 2: both discarded) and wakes by tags (``weights``, ``kv_cache``);
- its IPC path rebuilds CUDA handles on the receiver's current device: it is CUDA-only.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
from torch.multiprocessing import reductions

from weightstream.engines.base import BROADCAST, IPC, RELEASE_MEMORY, SINGLE_DTYPE, EngineError, EngineInfo, GroupSpec
from weightstream.engines.formats import settle_format
from weightstream.engines.http import HTTPEngine
from weightstream.models.spec import dtype_name
from weightstream.streaming.bucket import Bucket
from weightstream.wire.fp8 import BlockFP8, block_fp8_of

__all__ = ["log", "TAGS", "ipc_payload", "LMDeployEngine"]


log = logging.getLogger(__name__)

# LMDeploy's memory tags (``AsyncEngine.wakeup``).
TAGS = ("weights", "kv_cache")


def _one_dtype(bucket: Bucket, url: str, step: str) -> torch.dtype:
    dtypes = {m.dtype for m in bucket.metas}
    if len(dtypes) != 1:
        raise EngineError(url, step, f"bucket {bucket.index} holds dtypes {sorted(map(dtype_name, dtypes))}; "
                                     "LMDeploy's flattened bucket holds one (plan with single-dtype buckets)")
    return dtypes.pop()


def ipc_payload(bucket: Bucket, url: str = "lmdeploy") -> str:
    """LMDeploy's ``serialize_state_dict`` form: ``base64(ForkingPickler.dumps({...}))`` with the flat
    tensor (the bucket buffer viewed as its one dtype) as ``reduce_tensor``'s ``(rebuild, args)`` pair and
    ``start_idx``/``end_idx``/``numel`` in elements. ``require_clone=False``: the engine loads straight
    from our buffer, which stays untouched until it has answered."""
    dtype = _one_dtype(bucket, url, f"update_weights (bucket {bucket.index})")
    size = dtype.itemsize
    misplaced = [m.name for m in bucket.metas if m.offset % size]
    if misplaced:
        raise EngineError(url, "update_weights",
                          f"tensors not at a multiple of their element size {size}: {misplaced}")
    used = max(m.offset + m.nbytes for m in bucket.metas)
    flat = bucket.buffer.narrow(0, 0, used).view(dtype)
    metadata = []
    for m in bucket.metas:
        start = m.offset // size
        metadata.append(SimpleNamespace(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype,
                                        start_idx=start, end_idx=start + m.numel, numel=m.numel))
    state = {"metadata": metadata, "flattened_tensor": reductions.reduce_tensor(flat), "require_clone": False}
    return base64.b64encode(ForkingPickler.dumps(state)).decode("ascii")


class LMDeployEngine(HTTPEngine):
    """One LMDeploy ``api_server`` (PyTorch backend, all its TP ranks) behind one HTTP address."""

    name = "lmdeploy"

    def __init__(self, url: str, **kw: Any):
        super().__init__(url, **kw)
        self._finish: str | None = None  # the route of this session's buckets: it carries finished=True
        self._sleeping: set[str] | None = None  # None: not known (LMDeploy tells only whether it sleeps)
        self._warned_abort = False

    # -- what the engine is ------------------------------------------------------------------

    def server_info(self, refresh: bool = False) -> dict:
        """``GET /distserve/engine_info``: LMDeploy's ``DistServeEngineConfig``, which its route returns
        as a JSON string inside the JSON reply."""
        if refresh or self._server_info is None:
            reply = self.get("/distserve/engine_info", step="distserve/engine_info")
            if isinstance(reply, str):
                try:
                    reply = json.loads(reply)
                except ValueError:
                    reply = None
            if not isinstance(reply, dict) or "tp_size" not in reply:
                raise EngineError(self.url, "distserve/engine_info", f"not an LMDeploy engine config: {reply!r:.200}")
            self._server_info = reply
        return self._server_info

    def info(self, refresh: bool = False) -> EngineInfo:
        if self._info is None or refresh:
            s = self.server_info(refresh)
            fp8, conflicts = settle_format(self.stated, self.weight_format(s), None,
                                           reports_layout="quantization_config" in s, names_fp8_method=False)
            self._info = EngineInfo(
                engine=self.name, tp_size=int(s.get("tp_size") or 1), pp_size=int(s.get("pp_size") or 1),
                ep_size=int(s.get("ep_size") or 1), dp_size=int(s.get("dp_size") or 1),
                capabilities=self.capabilities(s), fp8=fp8, fp8_conflicts=conflicts,
            )
        return self._info

    def weight_format(self, server_info: dict) -> BlockFP8 | None:
        """None: LMDeploy 0.18 does not say how its model is quantized. ``/distserve/engine_info`` is its
        ``DistServeEngineConfig`` (parallel sizes, DP rank, KV-cache blocks) and no other route reports the
        model's ``quantization_config``, nor any quantization method: the layout is the one its user states
        (``fp8=`` or ``model_path=``), taken as stated (nothing to check it against). Its blocked-FP8 layers
        store float8 weights and their scales as they come and quantize other weights themselves on load
        (``quant_blocked_fp8``), so bf16 updates to an FP8 model load too; block-FP8 ones go where stated."""
        return block_fp8_of(server_info.get("quantization_config"))

    def capabilities(self, server_info: dict) -> frozenset[str]:
        return frozenset({BROADCAST, IPC, RELEASE_MEMORY, SINGLE_DTYPE})

    def weight_version(self) -> str | None:
        """LMDeploy keeps none: the version of the last update this adapter committed."""
        return self._version

    # -- generation and sessions -----------------------------------------------------------------

    def pause(self, mode: str = "abort") -> None:
        """Abort the requests in flight (``/abort_request`` with ``abort_all``), where the server was started
        with ``--enable-abort-handling``. Without it LMDeploy answers 501: requests in flight then keep
        running between the update's buckets (LMDeploy loads each bucket between two forward steps)."""
        if mode not in ("abort",):
            log.info("LMDeploy has no %r pause; requests in flight are aborted", mode)
        try:
            self.post("/abort_request", {"abort_all": True}, step="abort_request")
        except EngineError as exc:
            if "HTTP 501" not in exc.detail:
                raise
            if not self._warned_abort:
                self._warned_abort = True
                log.warning("LMDeploy at %s cannot abort requests (start it with --enable-abort-handling): "
                            "requests in flight run on across the update", self.url)

    def resume(self, timeout_s: float | None = None) -> None:
        """Nothing to do: LMDeploy serves as soon as it is awake."""

    def begin_update(self, version: str | None, timeout_s: float | None = None) -> None:
        self._version = version
        self._finish = None
        self._session = True

    def _finish_update(self, timeout_s: float | None = None) -> None:
        """The empty request with ``finished=True``: LMDeploy's post-load processing, and its cached IPC
        tensor released."""
        if self._finish == "/update_weights":
            self.post("/update_weights", {"serialized_named_tensors": self._empty_payload(),
                                          "load_format": "flattened_bucket", "finished": True},
                      step="update_weights (finished)", timeout_s=timeout_s)
        elif self._finish == "/update_weights_from_distributed":
            self.post("/update_weights_from_distributed", {
                "names": [], "dtypes": [], "shapes": [], "group_name": self.group_name,
                "load_format": "flattened_bucket", "finished": True,
            }, step="update_weights_from_distributed (finished)", timeout_s=timeout_s)
        self._finish = None

    def commit_update(self) -> str | None:
        self._session = False
        self._finish_update()
        return self.weight_version()

    def abort_update(self, timeout_s: float | None = None) -> None:
        """LMDeploy cannot roll back: what was loaded stays; the post-load processing still runs so the
        model is consistent (the caller reports the failure)."""
        if not self._session:
            return
        self._session = False
        self._finish_update(timeout_s)

    # -- the group -------------------------------------------------------------------------------

    def join_group(self, spec: GroupSpec) -> None:
        """``rank_offset``: this engine's TP rank r joins as ``rank_offset + r`` (LMDeploy has no bound of its
        own on the rendezvous; this trainer stops waiting at ``spec.timeout_s``)."""
        self.post("/init_weights_update_group", {
            "master_address": spec.master_address, "master_port": spec.master_port,
            "rank_offset": spec.rank_offset, "world_size": spec.world_size, "group_name": spec.group_name,
            "backend": spec.backend,
        }, step="init_weights_update_group", timeout_s=spec.timeout_s + 2.0)

    def leave_group(self, timeout_s: float | None = None) -> None:
        self.post("/destroy_weights_update_group", {"group_name": self.group_name},
                  step="destroy_weights_update_group", timeout_s=timeout_s)

    # -- buckets ---------------------------------------------------------------------------------

    def receive_broadcast(self, bucket: Bucket, checksum: str | None) -> None:
        """A dense bucket of one dtype: LMDeploy's receiver allocates ``FlattenedTensorBucket`` of the named
        tensors (back to back, in order) and receives the broadcast into it, byte for byte our buffer."""
        step = f"update_weights_from_distributed (bucket {bucket.index})"
        _one_dtype(bucket, self.url, step)
        self._finish = "/update_weights_from_distributed"
        self.post("/update_weights_from_distributed", {
            "names": [m.name for m in bucket.metas], "dtypes": [dtype_name(m.dtype) for m in bucket.metas],
            "shapes": [list(m.shape) for m in bucket.metas], "group_name": self.group_name,
            "load_format": "flattened_bucket", "finished": False,
        }, step=step)

    def encode_ipc(self, bucket: Bucket) -> str:
        """LMDeploy's ``serialize_state_dict`` form of this trainer rank's bucket (:func:`ipc_payload`)."""
        return ipc_payload(bucket, self.url)

    @staticmethod
    def _empty_payload() -> str:
        return base64.b64encode(ForkingPickler.dumps({"metadata": []})).decode("ascii")

    def receive_ipc(self, index: int, payloads: Sequence[Any], checksums: Sequence[str | None] | None) -> None:
        """One request per bucket; LMDeploy's TP rank r takes ``serialized_named_tensors[r]``."""
        self._finish = "/update_weights"
        self.post("/update_weights", {"serialized_named_tensors": list(payloads), "load_format": "flattened_bucket",
                                      "finished": False}, step=f"update_weights (bucket {index})")

    # -- memory ----------------------------------------------------------------------------------

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """LMDeploy sleeps whole: with ``weights`` among the tags (or none given) at level 2 (weights and KV
        cache discarded: the next update rewrites every weight), else at level 1 (weights offloaded to the
        host, KV cache freed)."""
        asked = set(tags or TAGS)
        unknown = asked - set(TAGS) - {"cuda_graph"}  # LMDeploy re-captures graphs itself
        if unknown:
            raise EngineError(self.url, "sleep", f"LMDeploy frees only {list(TAGS)}, not {sorted(unknown)}")
        level = 2 if "weights" in asked else 1
        self.post(f"/sleep?level={level}", {}, step=f"sleep (level {level})")
        self._sleeping = set(TAGS)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/wakeup?tags=...``. The KV cache is woken after the weights (LMDeploy warms up with them): asked
        for the KV cache alone while the weights may still sleep (level 1 offloaded them), the weights come
        back first (LMDeploy answers a wakeup of an awake tag with a no-op)."""
        asked = set(tags or TAGS)
        if "kv_cache" in asked and (self._sleeping is None or "weights" in self._sleeping):
            asked.add("weights")
        wanted = [t for t in TAGS if t in asked and (self._sleeping is None or t in self._sleeping)]
        if not wanted:
            return
        query = "&".join(f"tags={t}" for t in wanted)
        self.post(f"/wakeup?{query}", {}, step=f"wakeup ({', '.join(wanted)})")
        if self._sleeping is not None:
            self._sleeping -= set(wanted)

    def is_sleeping(self) -> bool:
        return bool(self.get("/is_sleeping", step="is_sleeping").get("is_sleeping"))
