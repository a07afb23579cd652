"""Serialising buckets for CUDA IPC / shared memory, and reading them back safely.

The sender pickles with ``ForkingPickler`` (CUDA tensors become IPC handles; CPU tensors torch's named
shared memory, ``file_system``), writing the GPU's UUID instead of its device index into CUDA handles so
that processes with different ``CUDA_VISIBLE_DEVICES`` agree. The receiver unpickles only through an
allow-list: a payload naming any other global, or calling a class that would allocate what it says, is
refused with :class:`UnsafePayloadError`; named shared memory is mapped only where a :class:`ShmGrant`
allows it (:func:`open_named_shm`).

weightstream's own control channel needs none of this on the CPU: there a buffer crosses as the descriptor
of its unnamed shared-memory file (:func:`share_fd`, :func:`map_fd`).
"""

from __future__ import annotations

import base64
import copyreg
import ctypes
import functools
import io
import mmap
import os
import pickle
import re
import stat
import sys
import threading
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar

import torch
from torch.multiprocessing import reductions

from weightstream.common import word_kernels
from weightstream.common.pickle_guard import PickleBoundError, check_pickle

__all__ = [
    "UnsafePayloadError", "gpu_uuid", "dumps", "dumps_b64", "ShmGrant", "SHM_HEADER_BYTES",
    "rebuild_cuda_tensor_by_uuid", "ALLOWED_GLOBALS", "SafeUnpickler", "loads", "loads_b64", "open_named_shm",
    "share_fd", "map_fd", "start_shm_manager_quietly", "checksum"
]


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


class _Pickler(ForkingPickler):
    _extra: ClassVar[dict] = {torch.Tensor: _reduce_tensor_with_uuid, torch.nn.Parameter: _reduce_tensor_with_uuid}
    # A class default of Pickler's per-instance attribute (as pickle documents), so not a ClassVar. typeshed
    # does not declare ForkingPickler._extra_reducers, its class-level table of registered reducers.
    dispatch_table: dict = {
        **ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
        **copyreg.dispatch_table,
        **_extra,
    }


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for another process: CUDA tensors as IPC handles, CPU tensors as torch's named shared
    memory (``file_system``, which another process can open; its manager started quietly)."""
    if not torch.cuda.is_available():
        torch.multiprocessing.set_sharing_strategy("file_system")
        start_shm_manager_quietly()
    buf = io.BytesIO()
    _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def dumps_b64(obj: Any) -> str:
    return base64.b64encode(dumps(obj)).decode("ascii")


_TORCH_DTYPES = {
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
}


@dataclass(frozen=True, slots=True)
class ShmGrant:
    """Which named shared-memory objects a payload may have this process map: those torch names
    ``/torch_<pid>_<n>_<n>`` for a process in ``pids`` (the senders the receiver knows by the kernel's word:
    itself, its engine's own process, the trainer ranks at the other end of its control channels), each of
    at most ``max_bytes``."""

    pids: frozenset[int]
    max_bytes: int = 1 << 40

    @classmethod
    def own(cls) -> ShmGrant:
        return cls(frozenset({os.getpid()}))


class _Named:
    """A class a payload may name as an argument of a rebuild function below, and never call: ``torch.Tensor``
    or ``torch.UntypedStorage`` called from a pickle would allocate whatever size it says."""

    __slots__ = ("what",)
    what: str

    def __init__(self, what: str):
        object.__setattr__(self, "what", what)

    def __call__(self, *args, **kwargs):
        raise UnsafePayloadError(f"refused to call {self.what} from a payload")

    def __setattr__(self, name, value):
        raise UnsafePayloadError(f"refused to change {self.what} from a payload")

    def __setstate__(self, state):
        raise UnsafePayloadError(f"refused to change {self.what} from a payload")


_TENSOR = _Named("torch.Tensor")
_STORAGE = _Named("torch.storage.UntypedStorage")
_TYPED = _Named("torch.storage.TypedStorage")
_CLASSES = {_TENSOR: torch.Tensor, _STORAGE: torch.UntypedStorage, _TYPED: torch.storage.TypedStorage}
_SHM_NAME = re.compile(r"/torch_([0-9]{1,10})_[0-9]{1,20}_[0-9]{1,20}")
# torch's named shared memory (``RefcountedMapAllocator``): a header of this many bytes, its reference count
# (int32) first, then the data. tests/test_ipc_lifecycle.py checks it against the torch installed.
SHM_HEADER_BYTES = 64


def _rebuild_tensor(cls, storage, metadata):
    """``reductions.rebuild_tensor`` for plain tensors over a storage the payload rebuilt (bounds checked by
    torch)."""
    if cls is not _TENSOR or not isinstance(storage, (torch.UntypedStorage, torch.TypedStorage)):
        raise UnsafePayloadError("a tensor in a payload must be a torch.Tensor over a shared storage")
    if not (isinstance(metadata, tuple) and len(metadata) == 4):
        raise UnsafePayloadError("a tensor's metadata in a payload must be (offset, size, stride, requires_grad)")
    return reductions.rebuild_tensor(torch.Tensor, storage, metadata)


def _rebuild_typed_storage(storage, dtype):
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise UnsafePayloadError("a typed storage in a payload must wrap a shared storage")
    return reductions.rebuild_typed_storage(storage, dtype)


def _rebuild_storage_empty(cls):
    if cls is not _STORAGE:
        raise UnsafePayloadError("an empty storage in a payload must be a torch.UntypedStorage")
    return torch.UntypedStorage()


def _rebuild_storage_filename(grant: ShmGrant, cls, manager, handle, size, dtype=None):
    """``reductions.rebuild_storage_filename``, where the object is one ``grant`` allows, mapped without torch's
    shared-memory manager: see :func:`open_named_shm`."""
    if cls is not _STORAGE or dtype is not None or not isinstance(handle, bytes) or not isinstance(size, int):
        raise UnsafePayloadError("a shared storage in a payload must be an untyped storage named by bytes")
    return open_named_shm(handle.decode("ascii", "replace"), size, grant)


def rebuild_cuda_tensor_by_uuid(*given):
    """The receiving end of :func:`_reduce_tensor_with_uuid`: the GPU's UUID back to a device index, the
    classes named by the payload back to torch's own."""
    args = list(given)
    if len(args) != 15 or args[0] is not _TENSOR or args[4] not in (_STORAGE, _TYPED):
        raise UnsafePayloadError("a CUDA tensor in a payload must be a torch.Tensor over a torch storage")
    args[0], args[4] = _CLASSES[args[0]], _CLASSES[args[4]]
    args[6] = _uuid_to_index(args[6])
    return reductions.rebuild_cuda_tensor(*args)


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", n): getattr(__import__("builtins"), n)
    for n in ("list", "dict", "tuple", "set", "frozenset", "int", "float", "str", "bool", "slice", "complex")
}
ALLOWED_GLOBALS.update(
    {
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
        ("types", "SimpleNamespace"): __import__("types").SimpleNamespace,
        ("torch", "Tensor"): _TENSOR,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch.storage", "UntypedStorage"): _STORAGE,
        ("torch.storage", "TypedStorage"): _TYPED,
        ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): rebuild_cuda_tensor_by_uuid,
        ("weightstream.wire.handles", "rebuild_cuda_tensor_by_uuid"): rebuild_cuda_tensor_by_uuid,
    }
)
ALLOWED_GLOBALS.update({("torch", n): getattr(torch, n) for n in _TORCH_DTYPES})
_FILENAME = ("torch.multiprocessing.reductions", "rebuild_storage_filename")


class SafeUnpickler(pickle.Unpickler):
    """Globals on :data:`ALLOWED_GLOBALS` only (no ``bytes``/``bytearray``, no class a payload could call to
    allocate), and named shared memory only where ``grant`` allows it."""

    def __init__(self, file, grant: ShmGrant):
        super().__init__(file)
        self.grant = grant

    def find_class(self, module: str, name: str):
        if (module, name) == _FILENAME:
            return functools.partial(_rebuild_storage_filename, self.grant)
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise UnsafePayloadError(f"refused to unpickle global {module}.{name}: not on the allow-list") from None


def loads(data: bytes, grant: ShmGrant | None = None) -> Any:
    """``grant``: the named shared memory the payload may map (by default: what this process shared itself).
    The pickle is measured first (:func:`~weightstream.common.pickle_guard.check_pickle`): one that would build
    out of proportion to its length is refused before anything is unpickled."""
    try:
        check_pickle(data)
    except PickleBoundError as exc:
        raise UnsafePayloadError(f"refused a payload of {len(data):,} bytes: {exc}") from None
    return SafeUnpickler(io.BytesIO(data), grant or ShmGrant.own()).load()


def loads_b64(text: str | bytes, grant: ShmGrant | None = None) -> Any:
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise UnsafePayloadError(f"payload is not valid base64: {exc}") from None
    return loads(data, grant)


# -- shared memory on the CPU ------------------------------------------------------------------------


def open_named_shm(name: str, nbytes: int, grant: ShmGrant) -> torch.UntypedStorage:
    """The data of torch's named shared-memory object ``name`` (a payload pickled with the ``file_system``
    strategy), where ``grant`` allows it: a name torch gives, made by a process the grant knows (the opened file
    belongs to this user and that process maps it: :func:`_ownership_problem`), of exactly ``nbytes`` (never
    grown); one refused is neither mapped nor unlinked. It is mapped here directly, not through the sender's
    ``torch_shm_manager`` (which torch's own rebuild connects to and never lets go: the manager, holding the
    sender's stdio, would live as long as this process). The reference the sender took for the payload in transit is
    consumed (:func:`_consume_transit_reference`), so the object goes when its sender frees it."""
    match = _SHM_NAME.fullmatch(name)
    if match is None:
        raise UnsafePayloadError(f"refused shared-memory object {name!r}: not a name torch gives")
    if int(match.group(1)) not in grant.pids:
        raise UnsafePayloadError(f"refused shared-memory object {name!r}: made by process {match.group(1)}, "
                                 f"which has not announced itself to this session (known: {sorted(grant.pids)})")
    if not 0 < nbytes <= grant.max_bytes:
        raise UnsafePayloadError(f"refused shared-memory object {name!r} of {nbytes} bytes (at most {grant.max_bytes})")
    try:
        fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UnsafePayloadError(f"cannot open shared-memory object {name!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes + SHM_HEADER_BYTES:
            raise UnsafePayloadError(f"refused shared-memory object {name!r}: {info.st_size} bytes, not the "
                                     f"{nbytes} the payload names (+ {SHM_HEADER_BYTES})")
        if (problem := _ownership_problem(info, int(match.group(1)))) is not None:
            raise UnsafePayloadError(f"refused shared-memory object {name!r}: {problem}")
        whole = mmap.mmap(fd, info.st_size)
    finally:
        os.close(fd)
    _consume_transit_reference(whole, name)
    return torch.frombuffer(whole, dtype=torch.uint8, offset=SHM_HEADER_BYTES, count=nbytes).untyped_storage()


def _ownership_problem(info: os.stat_result, pid: int) -> str | None:
    """Why the object opened (``info``: the ``fstat`` of its descriptor) is not one process ``pid`` made and holds,
    as the kernel tells: it must belong to this process's user, and ``pid`` must map that very file (by device and
    inode; torch's sender maps what it shares for as long as its storage lives). A name is only a name: another
    process can make ``/torch_<pid>_...`` for any pid."""
    if info.st_uid != os.geteuid():
        return f"it belongs to user {info.st_uid}, not to this engine's ({os.geteuid()})"
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}"
    try:
        with open(f"/proc/{pid}/maps") as f:
            mapped = any(_maps_file(line, device, info.st_ino) for line in f)
    except OSError as exc:
        return f"the mappings of process {pid}, whose pid the name gives, cannot be read ({exc.strerror})"
    if not mapped:
        return f"process {pid}, whose pid the name gives, does not map it: another process made it"
    return None


def _maps_file(line: str, device: str, inode: int) -> bool:
    """Whether a line of ``/proc/PID/maps`` (address, perms, offset, device, inode, path) maps that file."""
    fields = line.split(maxsplit=5)
    return len(fields) >= 5 and fields[3] == device and fields[4] == str(inode)


def _consume_transit_reference(whole: mmap.mmap, name: str) -> None:
    """torch's sender counts one reference for a payload in transit (``reduce_storage``), which its receiver
    gives back once it has mapped the object; this receiver maps without counting itself, so it gives that
    one back and the count stays the sender's. Where that was the last (the sender freed its storage after
    pickling it), the name goes now, as torch's would when its receiver let go: the mapping stays. Not
    atomic: the sender does not touch the count while its payload is in transit (it waits for the
    receiver's answer), and no one else has the object."""
    count = ctypes.c_int32.from_buffer(whole)
    try:
        if count.value < 1:
            raise UnsafePayloadError(f"refused shared-memory object {name!r}: it counts {count.value} references, "
                                     "so no payload in transit holds one")
        count.value -= 1
        last = count.value == 0
    finally:
        del count  # the mapping can be closed once nothing exports it
    if last:
        os.unlink("/dev/shm" + name)


def share_fd(storage: torch.UntypedStorage) -> tuple[int, int]:
    """The descriptor of the unnamed shared-memory file that holds ``storage`` (moved there in place the first
    time: views of it follow), and its size. Nothing appears in /dev/shm and no manager process is started;
    the memory goes when the last mapping of it does. The descriptor stays the storage's: send it (SCM_RIGHTS),
    do not close it."""
    fd, size = storage._share_fd_cpu_()
    return fd, size


def map_fd(fd: int, nbytes: int) -> torch.Tensor:
    """A ``uint8`` tensor over the first ``nbytes`` of the shared-memory file ``fd`` (a shared mapping: writes
    go both ways; it keeps a descriptor of its own, so the caller closes ``fd``)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or not 0 < nbytes <= info.st_size:
        raise ValueError(f"descriptor {fd} is not a shared-memory file of at least {nbytes} bytes "
                         f"({info.st_size} bytes)")
    # torch's stubs do not declare this private constructor (the inverse of ``_share_fd_cpu_``).
    storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined]
    return torch.empty(0, dtype=torch.uint8).set_(storage)


_manager_quiet = threading.Lock()
_manager_started = False


def start_shm_manager_quietly() -> None:
    """Start this process's ``torch_shm_manager`` (what a ``file_system`` share needs) with nothing of ours:
    torch forks it on the first such share, and it inherits every descriptor children may inherit (stdin,
    stderr, and whatever the process was handed: under ``torchrun`` or ``out=$(...)`` the pipe its caller
    reads), then lives until 2 s after its last client is gone. Started here, once, with stdin and stderr on
    /dev/null and every other descriptor closed to it. Another thread writing to stderr in that moment
    (a few milliseconds) writes to /dev/null."""
    global _manager_started
    with _manager_quiet:
        if _manager_started:
            return
        sys.stderr.flush()
        inherited = [fd for fd in _open_fds() if fd > 2 and _inheritable(fd)]
        saved = [os.dup(0), os.dup(2)]
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for fd in inherited:
                os.set_inheritable(fd, False)
            os.dup2(null, 0)
            os.dup2(null, 2)
            torch.empty(1, dtype=torch.uint8).untyped_storage()._share_filename_cpu_()
            _manager_started = True
        finally:
            os.dup2(saved[0], 0)
            os.dup2(saved[1], 2)
            for fd in inherited:
                os.set_inheritable(fd, True)
            for fd in (*saved, null):
                os.close(fd)


def _open_fds() -> list[int]:
    return [int(fd) for fd in os.listdir("/proc/self/fd")]


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:  # the directory listing's own descriptor, closed by now
        return False


_MOD = word_kernels.MOD  # the period of the checksum's position weights


def checksum(buffer: torch.Tensor) -> str:
    """A position-sensitive checksum of a flat uint8 buffer, computed where the buffer lives: over its 32-bit
    words ``w_i``, the sum of the words and the sum of ``w_i * (i % 65521 + 1)`` (each modulo 2**48). The second
    is summed by columns of a ``[rows, 65521]`` view (the words' position within a row is their weight), so that
    no word is widened or multiplied in memory: a few passes over the bytes, not a dozen."""
    flat = buffer.reshape(-1)
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32)
    if word_kernels.available(words.device):  # the same two sums, in one pass
        s1, s2 = word_kernels.checksum_sums(words)
        return f"{buffer.numel():x}-{s1 & 0xFFFFFFFFFFFF:x}-{s2 & 0xFFFFFFFFFFFF:x}"
    rows = words.numel() // _MOD
    s1 = int(words.sum(dtype=torch.int64).item())
    s2 = 0
    if rows:
        columns = words.narrow(0, 0, rows * _MOD).view(rows, _MOD).sum(dim=0, dtype=torch.int64)
        s2 = int((columns * torch.arange(1, _MOD + 1, device=words.device, dtype=torch.int64)).sum().item())
    tail = words.narrow(0, rows * _MOD, words.numel() - rows * _MOD).to(torch.int64)
    s2 += int((tail * torch.arange(1, tail.numel() + 1, device=words.device, dtype=torch.int64)).sum().item())
    return f"{buffer.numel():x}-{s1 & 0xFFFFFFFFFFFF:x}-{s2 & 0xFFFFFFFFFFFF:x}"
