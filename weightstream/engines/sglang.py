"""SGLang's HTTP weight-update protocol (0.5.x; field names as ``sglang/srt/managers/io_struct.py``
spells them, see ``docs/engines.md``). Endpoint names and payload fields live here and nowhere else."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from weightstream.engines.base import (
    BROADCAST,
    IPC,
    IPC_DELTA,
    RELEASE_MEMORY,
    DeltaChecks,
    EngineError,
    EngineInfo,
    GroupSpec,
)
from weightstream.engines.formats import settle_format
from weightstream.engines.http import HTTPEngine
from weightstream.engines.sglang_inside import LoaderClient, RankDelta, bucket_payload, engine_delta, failures
from weightstream.models.spec import dtype_name
from weightstream.streaming.bucket import Bucket
from weightstream.wire.fp8 import BlockFP8, block_fp8_of
from weightstream.wire.handles import dumps_b64

__all__ = ["log", "SGLangEngine"]


log = logging.getLogger(__name__)


class SGLangEngine(HTTPEngine):
    """One SGLang server (all its TP ranks) behind one HTTP address."""

    name = "sglang"

    def __init__(self, url: str, *, custom_loader: str | None = None, **options: Any):
        """``custom_loader``: the server was started with ``--custom-weight-loader`` naming weightstream's loader
        (:data:`~weightstream.engines.sglang_inside.LOADER`); IPC buckets then go through it (checksums verified
        and deltas applied inside SGLang, every TP rank's outcome read back), and the engine takes delta updates
        by IPC, one request per bucket (:data:`~weightstream.engines.base.IPC_DELTA`; :meth:`delta_base`,
        :meth:`delta_checks` from the loaders' answers)."""
        super().__init__(url, **options)
        self.loader = None if custom_loader is None else LoaderClient(custom_loader, self.timeout_s)
        self._delta_sent = False  # the open session sent delta buckets (the commit names their version)

    # -- what the engine is ------------------------------------------------------------------

    def server_info(self, refresh: bool = False) -> dict:
        if refresh or self._server_info is None:
            self._server_info = self.get("/get_server_info", step="get_server_info")
        return self._server_info

    def info(self, refresh: bool = False) -> EngineInfo:
        if self._info is None or refresh:
            s = self.server_info(refresh)
            fp8, conflicts = settle_format(self.stated, self.weight_format(s), s.get("quantization"),
                                           reports_layout="quantization_config" in s, names_fp8_method=False)
            self._info = EngineInfo(
                engine=self.name, tp_size=int(s.get("tp_size", 1)), pp_size=int(s.get("pp_size", 1)),
                ep_size=int(s.get("ep_size", 1)), dp_size=int(s.get("dp_size", 1)),
                gpu_uuids=tuple(s.get("gpu_uuids") or ()), capabilities=self.capabilities(s),
                fp8=fp8, quantization=self.fp8_method(s), fp8_conflicts=conflicts,
            )
        return self._info

    def capabilities(self, server_info: dict) -> frozenset[str]:
        """Broadcast, IPC and memory release; with ``custom_loader``, delta buckets by IPC, one request per bucket
        (:data:`~weightstream.engines.base.IPC_DELTA`). Never :data:`~weightstream.engines.base.DELTA`: only
        ``/update_weights_from_tensor`` reaches the loader (SGLang's ``WeightUpdater.update_weights_from_tensor``
        calls a listed ``load_format``), while ``/update_weights_from_distributed`` receives each bucket's whole
        size into SGLang's own buffers and loads them through the model (``receive_weights_from_distributed``,
        ``load_weights_from_distributed``), whatever the request names; a delta-mode update by broadcast is
        refused."""
        return frozenset({BROADCAST, IPC, RELEASE_MEMORY} | ({IPC_DELTA} if self.loader is not None else set()))

    def weight_format(self, server_info: dict) -> BlockFP8 | None:
        """The block-FP8 layout of the served model, from the ``quantization_config`` the server reports.

        SGLang 0.5.23 reports none: ``/get_server_info`` (= ``/server_info``) is its resolved server arguments
        plus scheduler state, with ``quantization`` (the ``--quantization`` argument, ``None`` for an FP8
        checkpoint whose method SGLang detects itself, except on sm100) but neither ``quantization_config`` nor
        ``weight_block_size``; ``/model_info`` has no quantization field. So for SGLang this is None, and the
        layout is the one its user states (``fp8=`` or ``model_path=``; see :func:`settle_format`: SGLang names
        no method for an FP8 checkpoint it detects itself, so only another method it names contradicts a stated
        block layout). An engine that reports such a config (the reference engine) is read from it."""
        return block_fp8_of(server_info.get("quantization_config"))

    def fp8_method(self, server_info: dict) -> str | None:
        """The FP8 method the server names (its ``--quantization``; ``"fp8"`` where a quantization config says
        so): SGLang casts an unquantized update into float8 parameters without scales, so the update refuses."""
        if block_fp8_of(server_info.get("quantization_config")) is not None:
            return "fp8"
        method = server_info.get("quantization")
        return str(method) if method and "fp8" in str(method) else None

    def weight_version(self) -> str:
        return str(self.get("/model_info", step="model_info").get("weight_version"))

    # -- generation and sessions -----------------------------------------------------------------

    def pause(self, mode: str = "abort") -> None:
        self.post("/pause_generation", {"mode": mode}, step="pause_generation")

    def resume(self, timeout_s: float | None = None) -> None:
        self.post("/continue_generation", {}, step="continue_generation", timeout_s=timeout_s)

    def begin_update(self, version: str | None, timeout_s: float | None = None) -> None:
        """Open a versioned session. ``timeout_s``: how long an engine that can may wait for this trainer
        between two steps before it gives the session up (SGLang ignores the field)."""
        self._version, self._delta_sent = version, False
        opening = self._loader_open_body(version) if self.loader is not None else None
        self.post("/begin_weight_update", {"timeout_s": timeout_s} if timeout_s else {}, step="begin_weight_update")
        self._session = True
        if opening is not None:
            self._open_loader(opening)

    def _loader_open_body(self, version: str | None) -> dict[str, Any]:
        """The request that opens the session on every TP rank's loader; a server that cannot take it is refused
        before anything is sent."""
        assert self.loader is not None
        try:
            return self.loader.open_body(self.server_info(), version)
        except ValueError as exc:
            raise EngineError(self.url, "custom weight loader", str(exc)) from None

    def _open_loader(self, body: dict[str, Any]) -> None:
        """Every TP rank's loader learns this session and where to report (``open``); each rank's answer read."""
        assert self.loader is not None
        self.post("/update_weights_from_tensor", body, step="update_weights_from_tensor (open the loader)")
        problem = self.loader.problem("open", self.tp_size)
        if problem:
            raise EngineError(self.url, "custom weight loader (open)", problem)

    def commit_update(self) -> str | None:
        """Where the session sent delta buckets, every TP rank's loader first keeps their bytes as this version's
        (:meth:`delta_base`; a rank that misses that word keeps none: the next update is full), then SGLang ends
        the session."""
        delta, self._delta_sent = self._delta_sent, False
        if delta and self._version is not None:
            self._delta_commit(self._version)
        self.post("/end_weight_update", {}, step="end_weight_update")
        self._session = False  # a commit that failed is ended again by the abort
        self.post("/flush_cache", {}, step="flush_cache")  # cached KV entries were computed with the old weights
        return self.weight_version()

    def abort_update(self, timeout_s: float | None = None) -> None:
        """SGLang cannot roll back: the session is ended as it stands (the caller reports the failure)."""
        if not self._session:
            return  # none was opened (or it was already ended)
        self._session, self._delta_sent = False, False  # the loaders keep no version of a session not committed
        self.post("/end_weight_update", {}, step="end_weight_update", timeout_s=timeout_s)

    # -- the group -------------------------------------------------------------------------------

    def join_group(self, spec: GroupSpec) -> None:
        self.post("/init_weights_update_group", self._join_body(spec), step="init_weights_update_group",
                  timeout_s=spec.timeout_s + 2.0)
        # SGLang ignores timeout_s (its side of the rendezvous waits by torch's default); the reference
        # engine gives up at it. Either way this trainer stops waiting at its own bound.

    @staticmethod
    def _join_body(spec: GroupSpec) -> dict[str, Any]:
        return {"master_address": spec.master_address, "master_port": spec.master_port,
                "rank_offset": spec.rank_offset, "world_size": spec.world_size, "group_name": spec.group_name,
                "backend": spec.backend, "timeout_s": spec.timeout_s}

    def leave_group(self, timeout_s: float | None = None) -> None:
        self.post("/destroy_weights_update_group", {"group_name": self.group_name},
                  step="destroy_weights_update_group", timeout_s=timeout_s)

    # -- buckets ---------------------------------------------------------------------------------

    def receive_broadcast(self, bucket: Bucket, checksum: str | None) -> None:
        """The metadata of one dense (back-to-back) bucket whose buffer is being broadcast."""
        self.post("/update_weights_from_distributed", self._broadcast_body(bucket, checksum),
                  step=f"update_weights_from_distributed (bucket {bucket.index})")

    def _broadcast_body(self, bucket: Bucket, checksum: str | None) -> dict:
        return {
            "names": [m.name for m in bucket.metas], "dtypes": [dtype_name(m.dtype) for m in bucket.metas],
            "shapes": [list(m.shape) for m in bucket.metas], "group_name": self.group_name,
            "flush_cache": False, "load_format": "flattened_bucket", "weight_version": self._version,
            "weightstream_checksum": checksum,
        }

    def encode_ipc(self, bucket: Bucket) -> str:
        """SGLang's flattened-bucket payload for ``/update_weights_from_tensor``: offsets and ``numel`` in
        bytes, as SGLang's own ``FlattenedTensorBucket`` writes them (over its ``uint8`` buffer); with
        ``custom_loader``, the loader's payload (:func:`~weightstream.engines.sglang_inside.bucket_payload`)."""
        if self.loader is not None:
            self._delta_sent = self._delta_sent or bucket.delta is not None
            return bucket_payload(bucket)
        metadata = [
            SimpleNamespace(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype, start_idx=m.offset,
                            end_idx=m.offset + m.nbytes, numel=m.nbytes)
            for m in bucket.metas
        ]
        return dumps_b64({"flattened_tensor": bucket.buffer, "metadata": metadata})

    def receive_ipc(self, index: int, payloads: Sequence[Any], checksums: Sequence[str | None] | None) -> None:
        if self.loader is not None:
            step = f"update_weights_from_tensor (bucket {index}, custom weight loader)"
            self.post("/update_weights_from_tensor", self.loader.body(payloads, self._version), step=step)
            problem = self.loader.problem(str(index), self.tp_size)
            if problem:
                raise EngineError(self.url, step, problem)
            return
        self.post("/update_weights_from_tensor", {
            "serialized_named_tensors": list(payloads), "load_format": "flattened_bucket",
            "flush_cache": False, "weight_version": self._version,
            "weightstream_checksums": list(checksums) if checksums else None,
        }, step=f"update_weights_from_tensor (bucket {index})")

    # -- delta updates (with custom_loader) --------------------------------------------------------

    def _loader_query(self, op: str, version: str | None = None) -> list[RankDelta | None]:
        """``op`` (``state`` or ``commit``) on every TP rank's loader, in the open session; each rank's answer
        (its delta state, for ``state``). Raises :class:`EngineError` naming every rank that failed."""
        if self.loader is None:
            raise EngineError(self.url, f"custom weight loader ({op})", "the adapter was made without custom_loader")
        step = f"update_weights_from_tensor (custom weight loader, {op})"
        body, name = self.loader.query(op, self.tp_size, version)
        self.post("/update_weights_from_tensor", body, step=step)
        outcomes = self.loader.answers(op, name, self.tp_size)
        missing = [o.rank for o in outcomes if o.ok and op == "state" and o.delta is None]
        problem = failures(outcomes) or (f"TP ranks {missing} answered no delta state" if missing else None)
        if problem:
            raise EngineError(self.url, step, problem)
        return [o.delta for o in outcomes]

    def _delta_commit(self, version: str) -> None:
        try:
            self._loader_query("commit", version)
        except EngineError as exc:  # the weights are loaded; only the base for the next delta is lost
            log.warning("%s: the loaders keep no delta base (%s): the next update is full", self.url, exc.detail)

    def delta_base(self) -> str | None:
        """``instance/version`` of the last committed delta-mode update whose bucket bytes every TP rank keeps
        (asked afresh: a restart, an aborted or a plain update changes it)."""
        return self.delta_checks().base

    def delta_checks(self) -> DeltaChecks:
        return engine_delta([d for d in self._loader_query("state") if d is not None])

    # -- memory ----------------------------------------------------------------------------------

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self.post("/release_memory_occupation", {"tags": list(tags) if tags else None},
                  step="release_memory_occupation")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.post("/resume_memory_occupation", {"tags": list(tags) if tags else None},
                  step="resume_memory_occupation")

    # -- serving -----------------------------------------------------------------------------------

    def generate(self, input_ids: list[int], max_new_tokens: int = 8) -> dict:
        return self.post("/generate", {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens}},
                         step="generate")
