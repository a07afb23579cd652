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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

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


_ENGINE_CLS = None


def _engine_class():
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

    class WeightstreamTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        """Receives weightstream's broadcast buckets in one vLLM worker."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.group = None
            self.rank: int | None = None
            self._touched_moe: set[str] = set()
            self._reloading = False

        def init_transfer_engine(self, init_info) -> None:
            from weightstream.wire.groups import destroy_group, init_custom_process_group

            if self.group is not None:  # a trainer that reconnects: the old group is gone on its side
                destroy_group(self.group)
                self.group = None
            pc = self.parallel_config
            worker_rank = pc.data_parallel_index * pc.world_size + pc.rank
            self.rank = int(init_info.rank_offset) + worker_rank
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            t0 = time.perf_counter()
            self.group = init_custom_process_group(
                backend, f"tcp://{init_info.master_address}:{int(init_info.master_port)}", int(init_info.world_size),
                self.rank, init_info.group_name, timedelta(seconds=float(init_info.timeout_s)))
            log.info("weightstream: rank %d of %d joined %r (%s) in %.3f s", self.rank, init_info.world_size,
                     init_info.group_name, backend, time.perf_counter() - t0)

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
            n = reprepack_cpu_moe(self.model, touched)
            if n:
                log.info("weightstream: re-packed %d CPU MoE layers", n)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host.
            try:
                self.receive_weights(self.parse_update_info(update_info))
                if self.device.type != "cpu" and torch.accelerator.is_available():
                    torch.accelerator.synchronize()
            except BaseException:
                # vLLM ends the session on any error here, so /finish_weight_update would be refused and the
                # model would keep the meta tensors of the layerwise reload: finalise now (layers that
                # received nothing get their old tensors back), then re-raise. The server keeps serving.
                log.exception("weightstream: update failed; finalising the reload before re-raising")
                try:
                    self.finish_weight_update()
                except Exception:  # noqa: BLE001 — the original error is the one to report
                    log.exception("weightstream: finalising after the failure failed too")
                raise

        def receive_weights(self, update_info) -> None:
            if self.group is None:
                raise RuntimeError("no weightstream group: call /init_weight_transfer_engine first")
            t0 = time.perf_counter()
            tensors, nbytes = receive_bucket(self.group, update_info, self.device)
            self.model.load_weights(tensors)
            for name, _ in tensors:
                moe = _moe_module(name)
                if moe is not None:
                    self._touched_moe.add(moe)
            log.info("weightstream: loaded %d tensors (%d bytes) in %.3f s", len(tensors), nbytes,
                     time.perf_counter() - t0)

        def shutdown(self) -> None:
            from weightstream.wire.groups import destroy_group

            group, self.group = self.group, None
            destroy_group(group)

    WeightstreamTransferEngine.__module__ = __name__
    WeightstreamTransferEngine.__qualname__ = ENGINE_CLASS_NAME
    _ENGINE_CLS = WeightstreamTransferEngine
    return _ENGINE_CLS


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
