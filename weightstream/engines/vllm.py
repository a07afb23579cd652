"""vLLM's HTTP weight-transfer protocol (0.32.0, dev-mode routes: ``VLLM_SERVER_DEV_MODE=1``), with the
``weightstream`` weight-transfer backend (``weightstream.integrations.vllm_backend``) on the engine side:
``--weight-transfer-config '{"backend": "weightstream"}'``. Endpoint names and payload fields live here
and nowhere else (see ``docs/engines.md``). With ``--worker-extension-cls`` naming the backend's
``WeightstreamWorkerExtension`` as well, the engine takes delta updates (:data:`~weightstream.engines.base.DELTA`,
``docs/delta.md``): its workers apply each bucket's delta to the bytes they keep of it, and ``/collective_rpc``
reads what they hold and applied."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from weightstream.engines.base import BROADCAST, DELTA, DeltaChecks, EngineError, EngineInfo, GroupSpec
from weightstream.engines.formats import settle_format
from weightstream.engines.http import HTTPEngine
from weightstream.models.spec import dtype_name
from weightstream.streaming.bucket import Bucket
from weightstream.wire.fp8 import BlockFP8

__all__ = [
    "PAUSE_MODES", "ONLINE_QUANTIZATION", "BACKEND", "WORKER_EXTENSION", "log", "WorkerDelta", "worker_deltas",
    "engine_delta", "VLLMEngine"
]


# SGLang-style pause modes (what WeightSync's pause_mode speaks) -> vLLM's /pause?mode=
PAUSE_MODES = {"abort": "abort", "retract": "wait", "in_place": "keep", "wait": "wait", "keep": "keep"}
# vLLM's quantization methods that quantize a bf16 checkpoint themselves at load (the engine takes bf16 updates)
ONLINE_QUANTIZATION = ("fp8_per_tensor", "fp8_per_block")
BACKEND = "weightstream"  # the weight-transfer backend (weightstream.integrations.vllm_backend.BACKEND_NAME)
# vLLM's --worker-extension-cls that serves the delta calls on each worker (vllm_backend.WORKER_EXTENSION)
WORKER_EXTENSION = "weightstream.integrations.vllm_backend.WeightstreamWorkerExtension"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerDelta:
    """What one vLLM worker holds for delta updates (``weightstream_delta_state``): its ``instance`` (made when
    it started), the committed ``version`` whose bucket bytes it keeps (None: none) and the checksum of each
    bucket's bytes the open (or last) session applied."""

    instance: str
    version: str | None
    buckets: dict[int, str]


def worker_deltas(reply: Any) -> list[WorkerDelta]:
    """The workers' answers to ``/collective_rpc weightstream_delta_state``, in worker rank order. Raises
    ``ValueError`` listing every malformed answer."""
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list) or not results:
        raise ValueError(f"no results in the reply: {str(reply)[:200]}")
    problems = [f"worker {r}: {str(w)[:200]}" for r, w in enumerate(results)
                if not (isinstance(w, dict) and isinstance(w.get("instance"), str)
                        and isinstance(w.get("version"), str | None) and isinstance(w.get("buckets"), dict))]
    if problems:
        raise ValueError("malformed delta states: " + "; ".join(problems))
    return [WorkerDelta(w["instance"], w["version"], {int(k): str(v) for k, v in w["buckets"].items()})
            for w in results]


def engine_delta(workers: Sequence[WorkerDelta]) -> DeltaChecks:
    """The engine's :class:`DeltaChecks` from its workers': its instance names every worker's (a restart of any
    changes it), its base is ``instance/version`` where every worker keeps the same committed version, and each
    bucket's checksums are per worker ("" where a worker applied none of it)."""
    return DeltaChecks.of_ranks([(w.instance, w.version, w.buckets) for w in workers])


class VLLMEngine(HTTPEngine):
    """One vLLM OpenAI server (all its workers) behind one HTTP address."""

    name = "vllm"

    def __init__(self, url: str, **kw: Any):
        super().__init__(url, **kw)
        self._model: str | None = None  # the served model's name, asked once
        self._delta_sent = False  # the open session sent delta buckets (the commit names their version)

    # -- what the engine is ------------------------------------------------------------------

    def server_info(self, refresh: bool = False) -> dict:
        """The parts of vLLM's config an update cares about (``GET /server_info?config_format=json``)."""
        if refresh or self._server_info is None:
            reply = self.get("/server_info?config_format=json", step="server_info")
            config = reply.get("vllm_config") if isinstance(reply, dict) else None
            if not isinstance(config, dict):
                raise EngineError(self.url, "server_info",
                                  "no vllm_config in the reply (is VLLM_SERVER_DEV_MODE=1 set?)")
            parallel = config.get("parallel_config") or {}
            device = config.get("device_config") or {}
            self._server_info = {
                "tp_size": int(parallel.get("tensor_parallel_size") or 1),
                "pp_size": int(parallel.get("pipeline_parallel_size") or 1),
                "dp_size": int(parallel.get("data_parallel_size") or 1),
                "ep": bool(parallel.get("enable_expert_parallel")),
                "device": str(device.get("device_type") or device.get("device") or "cpu"),
                "weight_transfer_backend": (config.get("weight_transfer_config") or {}).get("backend"),
                "worker_extension": parallel.get("worker_extension_cls") or None,
                "quantization": (config.get("model_config") or {}).get("quantization"),
            }
        return self._server_info

    def info(self, refresh: bool = False) -> EngineInfo:
        if self._info is None or refresh:
            s = self.server_info(refresh)
            fp8, conflicts = settle_format(self.stated, self.weight_format(s), s["quantization"],
                                           reports_layout=False, names_fp8_method=True)
            self._info = EngineInfo(engine=self.name, tp_size=s["tp_size"], pp_size=s["pp_size"],
                                    ep_size=s["tp_size"] * s["dp_size"] if s["ep"] else 1, dp_size=s["dp_size"],
                                    capabilities=self.capabilities(s), fp8=fp8,
                                    quantization=self.fp8_method(s), fp8_conflicts=conflicts)
        return self._info

    def weight_format(self, server_info: dict) -> BlockFP8 | None:
        """None: vLLM 0.32 does not say its block layout. ``/server_info`` gives ``model_config.quantization``
        (e.g. ``"fp8"``) but neither the checkpoint's ``quantization_config`` (``hf_config`` is not a dumped
        field) nor the ``Fp8Config`` (``quant_config`` is dumped as its ``repr``, ``<... object at 0x...>``).
        The layout is the one its user states (``fp8=`` or ``model_path=``), checked against the method vLLM
        names: ``fp8`` for a block-FP8 checkpoint, so a stated layout with any other (or none) is refused
        (:func:`settle_format`; see :meth:`fp8_method` for the unquantized updates)."""
        return None

    def fp8_method(self, server_info: dict) -> str | None:
        """The FP8 method of an FP8 checkpoint vLLM serves (``model_config.quantization``): it would cast an
        unquantized update silently into its float8 parameters, so the update refuses. vLLM's online methods
        quantize unquantized weights themselves at load: those take unquantized updates (None)."""
        method = server_info.get("quantization")
        return str(method) if method and "fp8" in str(method) and method not in ONLINE_QUANTIZATION else None

    def capabilities(self, server_info: dict) -> frozenset[str]:
        """Broadcast only, and only where the sinks' group accounting (``tp_size`` ranks per engine) is the
        engine's whole world (PP 1, DP 1); delta buckets by broadcast where the server runs weightstream's
        backend with its worker extension (``--worker-extension-cls`` :data:`WORKER_EXTENSION`). vLLM cannot roll
        back; sleep/wake do nothing on the CPU."""
        caps = set()
        if server_info.get("pp_size", 1) == 1 and server_info.get("dp_size", 1) == 1:
            caps.add(BROADCAST)
            if (server_info.get("weight_transfer_backend") == BACKEND
                    and server_info.get("worker_extension") == WORKER_EXTENSION):
                caps.add(DELTA)
        return frozenset(caps)

    def world_size(self) -> int:
        return int(self.get("/get_world_size", step="get_world_size")["world_size"])

    def weight_version(self) -> str | None:
        version = self.get("/weight_info", step="weight_info").get("weight_version")
        return None if version is None else str(version)

    # -- generation and sessions -----------------------------------------------------------------

    def pause(self, mode: str = "abort") -> None:
        try:
            vllm_mode = PAUSE_MODES[mode]
        except KeyError:
            raise EngineError(self.url, "pause", f"unknown pause mode {mode!r}; known: {sorted(PAUSE_MODES)}") from None
        self.post(f"/pause?mode={vllm_mode}", {}, step="pause")

    def resume(self, timeout_s: float | None = None) -> None:
        self.post("/resume", {}, step="resume", timeout_s=timeout_s)

    def begin_update(self, version: str | None, timeout_s: float | None = None) -> None:
        """Open a session (vLLM's layerwise reload starts). vLLM has no session bound: ``timeout_s`` is unused."""
        self._version = version
        self._delta_sent = False
        self.post("/start_weight_update", {}, step="start_weight_update")
        self._session = True

    def commit_update(self) -> str | None:
        """vLLM finishes the session; where it took delta buckets, its workers then keep their bytes as this
        version's (:meth:`delta_base`). A worker that misses that word keeps no base: the next update is full."""
        self._session = False
        delta, self._delta_sent = self._delta_sent, False
        self.post("/finish_weight_update", {"weight_version": self._version}, step="finish_weight_update")
        if delta and self._version is not None:
            self._delta_commit(self._version)
        return self.weight_version()

    def _delta_commit(self, version: str) -> None:
        try:
            self.post("/collective_rpc", {"method": "weightstream_delta_commit", "kwargs": {"version": version}},
                      step="collective_rpc weightstream_delta_commit")
        except EngineError as exc:  # the weights are committed; only the base for the next delta is lost
            log.warning("%s: the update is committed, but its workers keep no delta base (%s): the next "
                        "update is full", self.url, exc.detail)

    def abort_update(self, timeout_s: float | None = None) -> None:
        """vLLM cannot roll back: an open session is finished as it stands (what was loaded stays). After a
        failed bucket vLLM has already ended the session itself, so its refusal is expected and ignored."""
        if not self._session:
            return
        self._session = False
        self._delta_sent = False  # the workers keep no base of a session not committed
        try:
            self.post("/finish_weight_update", {"weight_version": None}, step="finish_weight_update (abort)",
                      timeout_s=timeout_s)
        except EngineError:
            pass

    # -- the group -------------------------------------------------------------------------------

    def join_group(self, spec: GroupSpec) -> None:
        """vLLM's workers join as ``rank_offset + r``; the backend picks gloo or NCCL from its device."""
        self.post("/init_weight_transfer_engine", {"init_info": {
            "master_address": spec.master_address, "master_port": spec.master_port,
            "rank_offset": spec.rank_offset, "world_size": spec.world_size, "timeout_s": spec.timeout_s,
            "group_name": spec.group_name,
        }}, step="init_weight_transfer_engine", timeout_s=spec.timeout_s + 2.0)

    def leave_group(self, timeout_s: float | None = None) -> None:
        self.post("/shutdown_weight_transfer_engine", {}, step="shutdown_weight_transfer_engine", timeout_s=timeout_s)

    # -- buckets ---------------------------------------------------------------------------------

    def receive_broadcast(self, bucket: Bucket, checksum: str | None) -> None:
        """The metadata of one dense (back-to-back) bucket whose buffer is being broadcast; answers when
        every worker has received and loaded it. A delta bucket (:data:`DELTA`) says how its payload is
        encoded and which bucket of the plan it is (``weightstream_delta``, as the reference engine takes it)."""
        info: dict[str, Any] = {
            "names": [m.name for m in bucket.metas], "dtype_names": [dtype_name(m.dtype) for m in bucket.metas],
            "shapes": [list(m.shape) for m in bucket.metas],
        }
        if checksum is not None:
            info["checksum"] = checksum
        if bucket.delta is not None:
            info["weightstream_delta"] = {**bucket.delta.as_json(), "index": bucket.index}
            self._delta_sent = True
        self.post("/update_weights", {"update_info": info}, step=f"update_weights (bucket {bucket.index})")

    # -- delta updates ---------------------------------------------------------------------------

    def _workers_delta(self) -> DeltaChecks:
        step = "collective_rpc weightstream_delta_state"
        reply = self.post("/collective_rpc", {"method": "weightstream_delta_state"}, step=step)
        try:
            return engine_delta(worker_deltas(reply))
        except ValueError as exc:
            raise EngineError(self.url, step, str(exc)) from None

    def delta_base(self) -> str | None:
        """``instance/version`` of the last committed delta-mode update whose bucket bytes every worker keeps
        (asked afresh: a restart, an aborted or a plain update changes it)."""
        return self._workers_delta().base

    def delta_checks(self) -> DeltaChecks:
        return self._workers_delta()

    # -- memory ----------------------------------------------------------------------------------

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self.post("/sleep?level=1", {}, step="sleep")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        query = "".join(f"&tags={quote(t)}" for t in tags or ()).lstrip("&")
        self.post("/wake_up" + (f"?{query}" if query else ""), {}, step="wake_up")

    # -- serving -----------------------------------------------------------------------------------

    def greedy(self, prompt_ids: list[int], max_tokens: int = 8) -> list[int]:
        """Greedy token ids after ``prompt_ids`` (``/v1/completions``, temperature 0)."""
        reply = self.post("/v1/completions", {
            "model": self.served_model(), "prompt": list(prompt_ids), "temperature": 0.0, "max_tokens": max_tokens,
            "return_token_ids": True, "ignore_eos": True,
        }, step="completions")
        try:
            return [int(t) for t in reply["choices"][0]["token_ids"]]
        except (KeyError, IndexError, TypeError):
            raise EngineError(self.url, "completions", f"no token ids in the reply: {str(reply)[:300]}") from None

    def served_model(self) -> str:
        if self._model is None:
            self._model = str(self.get("/v1/models", step="models")["data"][0]["id"])
        return self._model
