"""A vLLM weight-transfer backend named ``"weightstream"``: vLLM's workers join the trainer's
weight-update group and receive each bucket as ONE broadcast of its flat buffer.

Enable it with the ``vllm.general_plugins`` entry point ``weightstream =
"weightstream.integrations.vllm_backend:register"`` (vLLM loads it in every process, its workers
included) and ``--weight-transfer-config '{"backend": "weightstream"}'``. The HTTP side is
:class:`weightstream.engines.vllm.VLLMEngine`.

``/init_weight_transfer_engine {"init_info": {...}}``: ``master_address``, ``master_port``,
``rank_offset``, ``world_size``, ``timeout_s``, ``group_name``, meaning what they mean in
:class:`~weightstream.engines.base.GroupSpec` (the trainer's sender is rank 0 and hosts the
store; worker r joins as ``rank_offset + r``). The group is gloo on the CPU, NCCL on CUDA.

``/update_weights {"update_info": {...}}``: ``names``, ``dtype_names``, ``shapes`` and an optional
``checksum`` (:func:`weightstream.wire.handles.checksum` of the flat buffer). The buffer is
laid out back to back in ``names`` order (``weightstream.reference_engine.worker.dense_layout``).

vLLM is imported only when vLLM itself loads this module's engine (``register`` or the
``WeightstreamTransferEngine`` attribute), so ``import weightstream`` never needs vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from weightstream.wire.groups import destroy_group, init_custom_process_group

BACKEND_NAME = "weightstream"
ENGINE_CLASS_NAME = "WeightstreamTransferEngine"

log = logging.getLogger("weightstream.vllm")


class ChecksumMismatch(RuntimeError):
    pass


@dataclass
class WeightstreamInitInfo:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 60.0
    group_name: str = "weightstream"

    def __post_init__(self) -> None:
        if not self.group_name:
            raise ValueError("group_name must not be empty")
        if int(self.world_size) < 2 or int(self.rank_offset) < 1:
            raise ValueError(f"world_size {self.world_size} / rank_offset {self.rank_offset}: the trainer is rank 0")


@dataclass
class WeightstreamUpdateInfo:
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    checksum: str | None = None

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"names ({len(self.names)}), dtype_names ({len(self.dtype_names)}) and shapes "
                             f"({len(self.shapes)}) differ in length")


def receive_bucket(group, info: WeightstreamUpdateInfo, device: torch.device):
    """One broadcast from rank 0 into a buffer of the dense layout; the ``(name, tensor)`` views.
    Raises :class:`ChecksumMismatch` (naming the tensors) before anything is handed out."""
    from weightstream.reference_engine.worker import dense_layout
    from weightstream.streaming.bucket import view_tensor
    from weightstream.wire.handles import checksum

    metas = dense_layout(info.names, info.dtype_names, info.shapes)
    total = metas[-1].offset + metas[-1].nbytes if metas else 0
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    group.broadcast(buffer, 0).wait()
    if info.checksum is not None:
        got = checksum(buffer)
        if got != info.checksum:
            raise ChecksumMismatch(
                f"bucket of {len(metas)} tensors arrived corrupted (checksum {got} != sender's {info.checksum}); "
                f"nothing of it was loaded; its tensors: {[m.name for m in metas]}")
    return [(m.name, view_tensor(buffer, m)) for m in metas], total


def reprepack_cpu_moe(model: torch.nn.Module, touched: set[str]) -> int:
    """Re-pack the CPU fused-MoE layers named in ``touched`` (module names ending in ``.experts``).

    vLLM 0.32.0's unquantised fused-MoE method runs the CPU kernel's ``process_weights_after_loading``
    (where the experts are packed for its grouped GEMM) on the first load only; after a layerwise reload
    the experts stay in checkpoint layout and the model answers wrong tokens silently. Re-packing a layer
    that was not reloaded would pack packed weights, so only the loaded ones are."""
    count = 0
    if not touched:
        return 0
    for name, module in model.named_modules():
        if not any(name == t or name.startswith(t + ".") for t in touched):
            continue
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(module, "w13_weight"):
            continue
        if not type(experts).__module__.endswith("experts.cpu_moe"):
            continue
        experts.process_weights_after_loading(module)
        count += 1
    return count


def _moe_module(name: str) -> str | None:
    """``model.layers.3.mlp.experts.7.gate_proj.weight`` -> ``model.layers.3.mlp.experts``."""
    if ".experts." not in name:
        return None
    return name.split(".experts.")[0] + ".experts"


def _worker_rank(parallel_config: Any) -> int:
    """This vLLM worker's rank among all of the engine's workers (its data-parallel replicas included)."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def _join_group(init_info: WeightstreamInitInfo, rank: int, device: torch.device) -> Any:
    """The trainer's weight-update group, joined as ``rank`` (gloo on the CPU, NCCL on CUDA)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    t0 = time.perf_counter()
    group = init_custom_process_group(
        backend, f"tcp://{init_info.master_address}:{int(init_info.master_port)}", int(init_info.world_size),
        rank, init_info.group_name, timedelta(seconds=float(init_info.timeout_s)))
    log.info("weightstream: rank %d of %d joined %r (%s) in %.3f s", rank, init_info.world_size,
             init_info.group_name, backend, time.perf_counter() - t0)
    return group


def _load_bucket(group: Any, info: WeightstreamUpdateInfo, device: torch.device, model: Any) -> set[str]:
    """One bucket received through ``group`` (None before /init_weight_transfer_engine: an error) and loaded
    into ``model``; the MoE modules (``..experts``) it loaded into."""
    if group is None:
        raise RuntimeError("no weightstream group: call /init_weight_transfer_engine first")
    t0 = time.perf_counter()
    tensors, nbytes = receive_bucket(group, info, device)
    model.load_weights(tensors)
    touched = {moe for name, _ in tensors if (moe := _moe_module(name)) is not None}
    log.info("weightstream: loaded %d tensors (%d bytes) in %.3f s", len(tensors), nbytes,
             time.perf_counter() - t0)
    return touched


def _repack_touched(model: torch.nn.Module, touched: set[str]) -> None:
    """:func:`reprepack_cpu_moe` after a reload, logged."""
    n = reprepack_cpu_moe(model, touched)
    if n:
        log.info("weightstream: re-packed %d CPU MoE layers", n)


def _finish_after_failure(finish: Callable[[], None]) -> None:
    """Called while a failed update's error is handled. vLLM ends the session on any error there, so
    /finish_weight_update would be refused and the model would keep the meta tensors of the layerwise reload:
    ``finish`` (the engine's ``finish_weight_update``) finalises it now (layers that received nothing get their
    old tensors back). The server keeps serving."""
    log.exception("weightstream: update failed; finalising the reload before re-raising")
    try:
        finish()
    except Exception:  # noqa: BLE001 — the original error is the one to report
        log.exception("weightstream: finalising after the failure failed too")


_ENGINE_CLS: type | None = None


def _engine_class() -> type:
    """vLLM's ``WeightTransferEngine`` subclass, made on first use (this is where vLLM is imported)."""
    global _ENGINE_CLS
    if _ENGINE_CLS is not None:
        return _ENGINE_CLS

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class InitInfo(WeightstreamInitInfo, WeightTransferInitInfo):
        pass

    @dataclass
    class UpdateInfo(WeightstreamUpdateInfo, WeightTransferUpdateInfo):
        pass

    engine_cls = _transfer_engine_class(WeightTransferEngine, InitInfo, UpdateInfo)
    engine_cls.__module__ = __name__
    engine_cls.__qualname__ = ENGINE_CLASS_NAME
    _ENGINE_CLS = engine_cls
    return _ENGINE_CLS


def _transfer_engine_class(base: Any, init_cls: type, update_cls: type) -> type:
    """The engine class: vLLM's ``base`` (``WeightTransferEngine``) taking ``init_cls`` and ``update_cls``."""

    class WeightstreamTransferEngine(base[init_cls, update_cls]):
        """Receives weightstream's broadcast buckets in one vLLM worker."""

        init_info_cls = init_cls
        update_info_cls = update_cls
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.group = None
            self.rank: int | None = None
            self._touched_moe: set[str] = set()
            self._reloading = False

        def init_transfer_engine(self, init_info) -> None:
            if self.group is not None:  # a trainer that reconnects: the old group is gone on its side
                destroy_group(self.group)
                self.group = None
            self.rank = int(init_info.rank_offset) + _worker_rank(self.parallel_config)
            self.group = _join_group(init_info, self.rank, self.device)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self._touched_moe = set()
            initialize_layerwise_reload(self.model)
            self._reloading = True

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if not self._reloading:
                return
            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)
            touched, self._touched_moe = self._touched_moe, set()
            _repack_touched(self.model, touched)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host.
            try:
                self.receive_weights(self.parse_update_info(update_info))
                if self.device.type != "cpu" and torch.accelerator.is_available():
                    torch.accelerator.synchronize()
            except BaseException:
                _finish_after_failure(self.finish_weight_update)
                raise

        def receive_weights(self, update_info) -> None:
            self._touched_moe |= _load_bucket(self.group, update_info, self.device, self.model)

        def shutdown(self) -> None:
            group, self.group = self.group, None
            destroy_group(group)

    return WeightstreamTransferEngine


def __getattr__(name: str):
    if name == ENGINE_CLASS_NAME:
        return _engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``{"backend": "weightstream"}`` known (idempotent)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(BACKEND_NAME, __name__, ENGINE_CLASS_NAME)
