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
``checksum`` (:func:`weightstream.wire.handles.checksum` of the broadcast bytes). The buffer is
laid out back to back in ``names`` order (``weightstream.receiver.programs.dense_layout``).

Delta updates (``docs/delta.md``): a bucket whose ``update_info`` has ``weightstream_delta`` (``encoding``,
``word``, ``total``, ``count``, ``nbytes``, ``index``: :class:`~weightstream.streaming.delta.DeltaHeader` and the
bucket's index in the plan) is broadcast as its payload, ``nbytes`` bytes; the worker applies it to the bytes it
keeps of that bucket (the receiver layer's :class:`~weightstream.receiver.deltas.HeldDeltas`: every bucket it last
applied, one copy of the model per worker, at most twice the model's size) and
loads the bucket's new bytes as it loads a full one. With ``--worker-extension-cls`` naming
:class:`WeightstreamWorkerExtension`, ``/collective_rpc`` reads what each worker holds and applied
(``weightstream_delta_state``) and settles a committed update's version (``weightstream_delta_commit``).

vLLM is imported only when vLLM itself loads this module's engine (``register`` or the
``WeightstreamTransferEngine`` attribute), so ``import weightstream`` never needs vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch

from weightstream.receiver.backups import BackupPlace
from weightstream.receiver.deltas import HeldDeltas, held_limit
from weightstream.receiver.model import LoadableModel
from weightstream.receiver.pieces import Weight
from weightstream.receiver.programs import dense_layout, verify_checksum
from weightstream.receiver.schema import delta_problems, int_lists, unknown_dtypes
from weightstream.streaming.bucket import TensorMeta, view_tensor
from weightstream.streaming.delta import DeltaHeader, encoded_bytes
from weightstream.wire.groups import destroy_group, init_custom_process_group

__all__ = [
    "BACKEND_NAME", "ENGINE_CLASS_NAME", "WORKER_EXTENSION", "log", "ChecksumMismatch", "WeightstreamInitInfo",
    "WeightstreamUpdateInfo", "receive_bucket", "delta_state", "reprepack_cpu_moe", "VllmLoaded", "VllmModel",
    "WeightstreamWorkerExtension", "register"
]


BACKEND_NAME = "weightstream"
ENGINE_CLASS_NAME = "WeightstreamTransferEngine"
# vLLM's ``--worker-extension-cls`` for delta updates (the adapter declares ``delta`` where the server names it)
WORKER_EXTENSION = f"{__name__}.WeightstreamWorkerExtension"

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
    weightstream_delta: dict[str, Any] | None = None  # a delta bucket: its header and index in the plan

    def __post_init__(self) -> None:
        problems = _update_info_problems(self)
        if problems:
            raise ValueError("bad update_info: " + "; ".join(problems))

    def nbytes(self) -> int:
        """The bucket's bytes, its tensors back to back."""
        metas = _layout(self)
        return metas[-1].offset + metas[-1].nbytes if metas else 0

    def delta(self) -> tuple[int, DeltaHeader] | None:
        """The bucket's index in the plan and its delta header (None: a plain bucket, sent whole)."""
        d = self.weightstream_delta
        if d is None:
            return None
        return int(d["index"]), DeltaHeader.from_json(d)


def _update_info_problems(info: WeightstreamUpdateInfo) -> list[str]:
    """Every problem of a bucket's ``update_info``: its tensors' fields, and a delta header that is malformed or
    does not fit the bucket."""
    problems = []
    if not (len(info.names) == len(info.dtype_names) == len(info.shapes)):
        problems.append(f"names ({len(info.names)}), dtype_names ({len(info.dtype_names)}) and shapes "
                        f"({len(info.shapes)}) differ in length")
    unknown = unknown_dtypes(info.dtype_names)
    if unknown:
        problems.append(f"unknown dtype_names {unknown[:5]}")
    if not int_lists(info.shapes, 2):
        problems.append("shapes must be lists of non-negative integers")
    problems += delta_problems(info.weightstream_delta)
    if not problems and info.weightstream_delta is not None:
        problems += _delta_fit_problems(info.weightstream_delta, info.nbytes())
    return problems


def _delta_fit_problems(delta: dict[str, Any], nbytes: int) -> list[str]:
    """What in a well-formed delta header does not fit its bucket of ``nbytes``."""
    problems = []
    if delta["total"] != nbytes:
        problems.append(f"weightstream_delta.total {delta['total']} is not the bucket's {nbytes} bytes")
    size = encoded_bytes(delta["encoding"], delta["total"] // delta["word"], delta["count"], delta["word"])
    if delta["nbytes"] != size:
        problems.append(f"weightstream_delta.nbytes {delta['nbytes']} is not the {size} bytes of "
                        f"{delta['encoding']} for {delta['count']} changed words")
    return problems


def _layout(info: WeightstreamUpdateInfo) -> list[TensorMeta]:
    return dense_layout(info.names, info.dtype_names, info.shapes)


def receive_bucket(group, info: WeightstreamUpdateInfo, device: torch.device, held: HeldDeltas | None = None):
    """One broadcast from rank 0 into a buffer of the dense layout (or, a delta bucket, its payload applied to
    the bytes ``held`` of it: :meth:`HeldDeltas.new_bytes`; a bucket sent whole drops them:
    :meth:`HeldDeltas.loaded_whole`); the ``(name, tensor)`` views. Raises :class:`ChecksumMismatch` (naming the
    tensors) before anything is handed out."""
    metas = _layout(info)
    total = metas[-1].offset + metas[-1].nbytes if metas else 0
    delta = info.delta()
    buffer = torch.empty(total if delta is None else delta[1].nbytes, dtype=torch.uint8, device=device)
    group.broadcast(buffer, 0).wait()
    verify_checksum(buffer, info.checksum, f"bucket of {len(metas)} tensors",
                    lambda: f"; its tensors: {[m.name for m in metas]}", ChecksumMismatch)
    if delta is not None:
        if held is None:
            raise ValueError(f"delta bucket {delta[0]}: this worker keeps no bytes for deltas")
        buffer = held.new_bytes(delta[0], tuple(metas), total, delta[1], buffer, None)  # its checksum: above
    elif held is not None:
        held.loaded_whole()
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


@dataclass(frozen=True, slots=True)
class VllmLoaded:
    """What a load into vLLM's model answers (vLLM raises where a tensor does not fit: no problems returned)."""

    loaded: tuple[str, ...]
    problems: tuple[str, ...] = ()


class VllmModel:
    """vLLM's model as the receiver layer's :class:`~weightstream.receiver.model.LoadableModel`: every tensor goes
    through vLLM's own ``load_weights`` (no copy targets), a session is vLLM's layerwise reload (begun, then
    finalised, the CPU fused-MoE layers it loaded into re-packed), and keeps no rollback copies (vLLM cannot put
    its weights back: after a failure the layers that received nothing keep their old tensors). ``target``: the
    model an update goes into now, and its config (vLLM may set another: ``set_weight_update_target``)."""

    def __init__(self, target: Callable[[], tuple[Any, Any]]) -> None:
        self.target = target
        self.touched_moe: set[str] = set()  # the MoE modules (``..experts``) the open session loaded into
        self.reloading = False

    def whole_targets(self, metas: Any) -> None:
        return None

    def load_weights(self, weights: Iterable[Weight]) -> VllmLoaded:
        tensors = [(name, tensor) for name, tensor, _ in weights]
        self.target()[0].load_weights(tensors)
        self.touched_moe |= {moe for name, _ in tensors if (moe := _moe_module(name)) is not None}
        return VllmLoaded(tuple(name for name, _ in tensors))

    def begin_session(self) -> BackupPlace:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.touched_moe = set()
        initialize_layerwise_reload(self.target()[0])
        self.reloading = True
        return BackupPlace("none", "vLLM keeps no rollback copies")

    def commit_session(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self.reloading:
            return
        self.reloading = False
        model, model_config = self.target()
        finalize_layerwise_reload(model, model_config)
        touched, self.touched_moe = self.touched_moe, set()
        _repack_touched(model, touched)

    def rollback_session(self) -> int:
        """The reload finalised as a commit is (layers that received nothing get their old tensors back); nothing
        is restored."""
        self.commit_session()
        return 0


def _load_bucket(group: Any, info: WeightstreamUpdateInfo, device: torch.device, model: LoadableModel,
                 held: HeldDeltas | None = None) -> None:
    """One bucket received through ``group`` (None before /init_weight_transfer_engine: an error) and loaded
    into ``model`` (a delta bucket: its new bytes from ``held``, loaded whole)."""
    if group is None:
        raise RuntimeError("no weightstream group: call /init_weight_transfer_engine first")
    t0 = time.perf_counter()
    tensors, nbytes = receive_bucket(group, info, device, held)
    model.load_weights((name, tensor, None) for name, tensor in tensors)
    log.info("weightstream: loaded %d tensors (%d bytes) in %.3f s", len(tensors), nbytes,
             time.perf_counter() - t0)


def _repack_touched(model: torch.nn.Module, touched: set[str]) -> None:
    """:func:`reprepack_cpu_moe` after a reload, logged."""
    n = reprepack_cpu_moe(model, touched)
    if n:
        log.info("weightstream: re-packed %d CPU MoE layers", n)


def _finish_after_failure(finish: Callable[[], object]) -> None:
    """Called while a failed update's error is handled. vLLM ends the session on any error there, so
    /finish_weight_update would be refused and the model would keep the meta tensors of the layerwise reload:
    ``finish`` (the model's ``rollback_session``) finalises it now (layers that received nothing get their
    old tensors back). The server keeps serving."""
    log.exception("weightstream: update failed; finalising the reload before re-raising")
    try:
        finish()
    except Exception:  # the original error is the one to report
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
            self.loadable = VllmModel(lambda: (self.model, self.model_config))
            self.held = HeldDeltas()  # for delta updates (bounded at the first bucket)

        def init_transfer_engine(self, init_info) -> None:
            group, self.group = self.group, None
            destroy_group(group)  # a trainer that reconnects: the old group (if any) is gone on its side
            self.rank = int(init_info.rank_offset) + _worker_rank(self.parallel_config)
            self.group = _join_group(init_info, self.rank, self.device)

        def start_weight_update(self) -> None:
            self.held.begin()
            self.loadable.begin_session()

        def finish_weight_update(self) -> None:
            self.loadable.commit_session()

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host.
            try:
                self.receive_weights(self.parse_update_info(update_info))
                if self.device.type != "cpu" and torch.accelerator.is_available():
                    torch.accelerator.synchronize()
            except BaseException:
                _finish_after_failure(self.loadable.rollback_session)
                raise

        def receive_weights(self, update_info) -> None:
            if self.held.limit is None:  # every worker is sent every tensor whole; its model holds its part
                self.held.limit = held_limit(self.model.parameters(), self.parallel_config.world_size)
            _load_bucket(self.group, update_info, self.device, self.loadable, self.held)

        def shutdown(self) -> None:
            group, self.group = self.group, None
            destroy_group(group)

    return WeightstreamTransferEngine


def delta_state(held: HeldDeltas) -> dict[str, Any]:
    """What ``weightstream_delta_state`` answers for a worker's bytes ``held`` (JSON: bucket indices as strings;
    :func:`weightstream.engines.vllm.worker_deltas` reads it)."""
    return {"instance": held.instance, "version": held.version, "held_bytes": held.nbytes,
            "buckets": {str(i): d for i, d in sorted(held.checksums().items())}}


def _held_deltas(worker: Any) -> HeldDeltas:
    """What the weightstream weight-transfer engine of a vLLM worker (its ``weight_transfer_engine``) keeps."""
    engine, ours = worker.weight_transfer_engine, cast(Any, _engine_class())  # ours: made when vLLM loads it
    if not isinstance(engine, ours):
        raise RuntimeError(f"the worker's weight-transfer engine is {type(engine).__name__}, not weightstream's: "
                           "start vLLM with --weight-transfer-config '{\"backend\": \"weightstream\"}'")
    return engine.held


class WeightstreamWorkerExtension:
    """vLLM's ``--worker-extension-cls`` (:data:`WORKER_EXTENSION`): the calls ``/collective_rpc`` makes on each
    worker for delta updates. vLLM mixes it into its worker class, so ``self`` is the worker."""

    def weightstream_delta_state(self) -> dict[str, Any]:
        """This worker's instance, the committed version whose bucket bytes it holds, and the checksum of each
        bucket's bytes the open (or last) session applied (:func:`delta_state`)."""
        return delta_state(_held_deltas(self))

    def weightstream_delta_commit(self, version: str) -> None:
        """The session just finished was committed as ``version`` (:meth:`HeldDeltas.commit`)."""
        _held_deltas(self).commit(str(version))


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
