"""Serialising buckets for CUDA IPC / shared memory, and reading them back safely.

The sender pickles with ``ForkingPickler`` (CUDA tensors become IPC handles; CPU tensors shared
memory files), writing the GPU's UUID instead of its device index into CUDA handles so that
processes with different ``CUDA_VISIBLE_DEVICES`` agree. The receiver unpickles only through an
allow-list: a payload naming any other global is refused with :class:`UnsafePayloadError`.
"""

from __future__ import annotations

import base64
import copyreg
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions


class UnsafePayloadError(pickle.UnpicklingError):
    pass


def gpu_uuid(device: int | str | torch.device) -> str:
    """The UUID of a GPU: the name processes agree on whatever their ``CUDA_VISIBLE_DEVICES``."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _uuid_to_index(device: Any) -> int:
    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == device:
            return i
    raise UnsafePayloadError(f"no local GPU has UUID {device!r}")


def _reduce_tensor_with_uuid(tensor: torch.Tensor):
    """torch's own tensor reduction, with the CUDA device index (argument 6) replaced by the GPU UUID."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = list(args)
        args[6] = gpu_uuid(args[6])
        args = tuple(args)
    return rebuild, args


def rebuild_cuda_tensor_by_uuid(*args):
    """The receiving end of :func:`_reduce_tensor_with_uuid`."""
    args = list(args)
    args[6] = _uuid_to_index(args[6])
    return reductions.rebuild_cuda_tensor(*args)


class _Pickler(ForkingPickler):
    _extra = {torch.Tensor: _reduce_tensor_with_uuid, torch.nn.Parameter: _reduce_tensor_with_uuid}
    dispatch_table = {**ForkingPickler._extra_reducers, **copyreg.dispatch_table, **_extra}


def dumps(obj: Any) -> bytes:
    if not torch.cuda.is_available():
        torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def dumps_b64(obj: Any) -> str:
    return base64.b64encode(dumps(obj)).decode("ascii")


_TORCH_DTYPES = {
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
}

ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", n): getattr(__import__("builtins"), n)
    for n in ("list", "dict", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "slice", "complex", "bytearray")
}
ALLOWED_GLOBALS.update(
    {
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
        ("types", "SimpleNamespace"): __import__("types").SimpleNamespace,
        ("copyreg", "_reconstructor"): copyreg._reconstructor,
        ("torch", "Tensor"): torch.Tensor,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"): reductions.rebuild_storage_filename,
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): rebuild_cuda_tensor_by_uuid,
        ("weightstream.streaming.serialization", "rebuild_cuda_tensor_by_uuid"): rebuild_cuda_tensor_by_uuid,
    }
)
ALLOWED_GLOBALS.update({("torch", n): getattr(torch, n) for n in _TORCH_DTYPES})


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise UnsafePayloadError(f"refused to unpickle global {module}.{name}: not on the allow-list") from None


def loads(data: bytes) -> Any:
    return SafeUnpickler(io.BytesIO(data)).load()


def loads_b64(text: str | bytes) -> Any:
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise UnsafePayloadError(f"payload is not valid base64: {exc}") from None
    return loads(data)


def checksum(buffer: torch.Tensor) -> str:
    """A position-sensitive checksum of a flat uint8 buffer, computed where the buffer lives."""
    flat = buffer.reshape(-1)
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    s1 = int(words.sum().item())
    s2 = int((words * weights).sum().item())
    return f"{buffer.numel():x}-{s1 & 0xFFFFFFFFFFFF:x}-{s2 & 0xFFFFFFFFFFFF:x}"
