"""One engine TP rank: holds its shard, joins weight-update groups, and takes updates through the receiver layer
(:class:`~weightstream.receiver.receiver.Receiver`).

The server drives each worker through a pipe, one :class:`~weightstream.reference_engine.protocol.Command` at a
time, and gets back one ``Reply`` per command, carrying its id; workers of one engine also form their own
process group (the engine's TP group) for the forward pass and for completing vocabulary rows.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import Any

import torch
import torch.distributed as dist

from weightstream.common.phases import PhaseClock
from weightstream.common.processes import die_with_parent
from weightstream.converters.registry import get_converter
from weightstream.models.spec import dtype_from_name
from weightstream.receiver.ahead_plans import KeyedReceive
from weightstream.receiver.groups import UpdateGroups
from weightstream.receiver.pieces import engine_layout
from weightstream.receiver.plan import IpcReceive, Receive, TensorReceive
from weightstream.receiver.receiver import Receiver
from weightstream.receiver.requests import (
    DestroyGroupRequest,
    InitGroupRequest,
    ReleaseIpcRequest,
    WeightChecksumsRequest,
)
from weightstream.receiver.schema import ep_problem, routed_experts
from weightstream.receiver.session import Facilities
from weightstream.receiver.values import DEFAULT_CHECKS, LoadChecks
from weightstream.reference_engine.protocol import (
    START_ID,
    AbortSession,
    BeginSession,
    Command,
    CommitSession,
    DeltaChecksums,
    DestroyAllGroups,
    ForgetDelta,
    Generate,
    Layout,
    LogitsRequest,
    Memory,
    Outcome,
    OutOfTime,
    PrepareSession,
    ReleaseMemoryRequest,
    Reply,
    ResumeMemoryRequest,
    Shutdown,
    UpdatePhases,
)
from weightstream.wire.channel import fd_peer
from weightstream.wire.fp8 import block_fp8_of
from weightstream.wire.groups import tcp_store
from weightstream.wire.handles import checksum

__all__ = ["Worker", "worker_main"]


class Worker:
    def __init__(self, rank: int, size: int, model_dir: str, device: torch.device, dtype: torch.dtype, ep: int = 1):
        """``ep``: the engine's expert parallelism (1, or ``size``: each rank holds its routed experts whole)."""
        from transformers import AutoConfig

        from weightstream.reference_engine.model import ShardedCausalLM

        self.rank, self.size, self.device = rank, size, device
        # Where an update's time goes on this rank (``update_phases``): the open session's, and the last one's.
        self.clock = PhaseClock()
        self.config = AutoConfig.from_pretrained(model_dir)
        if (problem := ep_problem(ep, size, routed_experts(self.config.to_dict()))) is not None:
            raise ValueError(problem)
        self.model = ShardedCausalLM(self.config, rank, size, dist.group.WORLD, device, dtype, ep)
        self.groups = UpdateGroups(rank, device)
        self._load_initial(model_dir)
        # A buffer lent by name (a payload pickled by torch on the CPU), and the bytes held for delta updates, are
        # at most twice the model's size.
        max_lent_bytes = 2 * size * sum(st.nbytes() for st in self.model._storages())
        at = Facilities(rank, size, device, self.clock, self.groups.joined)
        self.receiver = self.make_receiver(at, max_lent_bytes)
        self.session = self.receiver.session

    def make_receiver(self, at: Facilities, max_lent_bytes: int) -> Receiver:
        """What this worker takes updates through (:meth:`Receiver.on` its model)."""
        return Receiver.on(self.model, at, max_lent_bytes)

    def _load_initial(self, model_dir: str) -> None:
        """The weights the checkpoint holds (a block-FP8 checkpoint's dequantized, by the same load an update
        takes); the model's FP8 layout from its ``quantization_config``."""
        from weightstream.common.hf_files import CheckpointReader

        fp8 = block_fp8_of(self.config.to_dict().get("quantization_config"))
        try:
            reader = CheckpointReader(model_dir)
        except FileNotFoundError:
            self.model.quantized(fp8, (), get_converter(self.config.model_type).quantizes)
            self.model.mark_never_loaded(set())  # weights come later, through an update
            return
        self.model.quantized(fp8, reader.keys())
        with reader:
            report = self.model.load_weights((n, reader.get(n), None) for n in reader.keys())
        if report.problems:
            raise RuntimeError("initial weights do not fit the model: " + "; ".join(report.problems))
        self.model.mark_never_loaded(set(report.loaded))

    # -- commands ----------------------------------------------------------------------------

    def init_group(self, r: InitGroupRequest) -> str:
        """Join a weight-update group (:meth:`UpdateGroups.join`)."""
        return self.groups.join(r)

    def release_memory(self, tags):
        """SGLang's tags: ``weights`` frees the weights (re-created, zeroed, by ``resume_memory``; an update
        must then load every tensor before the engine serves again); this engine keeps no KV cache and
        captures no CUDA graphs, so ``kv_cache`` and ``cuda_graph`` free nothing."""
        self.receiver.release()
        freed = self.model.release_weights() if "weights" in tags else 0
        return {"freed_bytes": freed, **self.memory()}

    def resume_memory(self, tags):
        self.receiver.forget_weight_views()
        restored = self.model.resume_weights() if "weights" in tags else 0
        return {"restored_bytes": restored, **self.memory()}

    def memory(self):
        """This worker's memory: the device's allocated bytes (CUDA) and the process's resident size, and what its
        receiver holds (:meth:`Receiver.stats`)."""
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        cuda = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        peak = torch.cuda.max_memory_allocated(self.device) - self.session.base if cuda is not None else None
        return {"rss_bytes": rss, "cuda_allocated_bytes": cuda, "session_peak_extra_cuda_bytes": peak,
                "backup_place": self.model.backup_at.where, "backup_why": self.model.backup_at.why,
                "backup_bytes": self.model.backup_bytes, "fds": len(os.listdir("/proc/self/fd")),
                "groups_warmed": self.groups.warmed, **self.receiver.stats()}

    def logits(self, input_ids):
        """Rank 0's logits as a numpy array: it crosses the pipe by value, so no shared storage of a reply (a
        descriptor and a socket to torch's memory manager) outlives it in this process."""
        out = self.model.logits(torch.tensor(input_ids))
        return out.float().cpu().numpy() if self.rank == 0 else None

    def generate(self, rows, max_new_tokens):
        """Greedy: each row's ``max_new_tokens`` new tokens, the rows one after another. Between two decode
        steps, work past the command's deadline stops (:class:`OutOfTime`, saying how far it got)."""
        outs = []
        for r, row in enumerate(rows):
            out: list[int] = []
            for step in range(max_new_tokens):
                if self._out_of_time():
                    raise OutOfTime(f"stopped in row {r} of {len(rows)} after {step} of its {max_new_tokens} "
                                    "new tokens")
                out += self.model.generate(list(row) + out, 1)
            outs.append(out)
        return outs

    deadline: float | None = None  # the running command's (see _run): time.monotonic() past which work stops

    def _out_of_time(self) -> bool:
        """Whether the running command's deadline has passed, as every rank of the engine agrees (one small
        all-reduce at TP > 1: no rank starts a forward pass that another has given up)."""
        late = self.deadline is not None and time.monotonic() > self.deadline
        if self.size == 1:
            return late
        flag = torch.tensor([int(late)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def layout(self) -> dict[str, dict[str, int | None] | dict[str, int]]:
        """How this rank holds the checkpoint's tensors: ``dims``, the dim each is split on (those held whole
        omitted), and ``owners``, the one rank that holds each tensor held by one rank alone (experts under expert
        parallelism)."""
        declared = engine_layout(self.model.params, self.size, self.model.owners())
        return {"dims": dict(declared.dims), "owners": dict(declared.owners)}

    def weight_checksums(self, names: list[str]) -> dict[str, str]:
        """The checksum (:func:`~weightstream.wire.handles.checksum`) of the bytes this rank holds of each of
        ``names`` it holds (its part of a split tensor); the names it does not hold are left out."""
        held = {n: self.model.params[n][0] for n in names if n in self.model.params}
        return {n: checksum(t.contiguous().reshape(-1).view(torch.uint8)) for n, t in held.items()}

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        """What the server may ask of this worker: per request type, what runs it (given the request)."""
        receiver, session = self.receiver, self.session
        return {
            InitGroupRequest: self.init_group, DestroyGroupRequest: lambda r: self.groups.leave(r.group_name),
            DestroyAllGroups: lambda _: self.groups.leave_all(), Receive: receiver.receive,
            KeyedReceive: receiver.receive_keyed,
            IpcReceive: receiver.receive_ipc, TensorReceive: receiver.receive_tensor,
            ReleaseIpcRequest: lambda r: receiver.ipc.release(r.client), BeginSession: lambda _: session.begin(),
            PrepareSession: lambda _: session.prepare(), CommitSession: lambda _: session.commit(),
            AbortSession: lambda _: session.abort(), ReleaseMemoryRequest: lambda r: self.release_memory(r.tags),
            ResumeMemoryRequest: lambda r: self.resume_memory(r.tags), Memory: lambda _: self.memory(),
            LogitsRequest: lambda r: self.logits(r.rows), Generate: lambda r: self.generate(r.rows, r.max_new_tokens),
            DeltaChecksums: lambda _: session.delta_checksums(), UpdatePhases: lambda _: session.phases(),
            Layout: lambda _: self.layout(), WeightChecksumsRequest: lambda r: self.weight_checksums(r.names),
            ForgetDelta: lambda _: session.forget_delta(),
        }

    def next_command(self, conn: Connection) -> Command:
        """The server's next command. Meanwhile the trainer's IPC lease is watched (:meth:`IpcReceiver.watch`):
        when the trainer's end closes, what this worker mapped of it is let go at once."""
        # The pipe is a socket pair the engine's process made: the kernel names that process, whatever started
        # this worker (a fork server, spawn).
        ipc = self.receiver.ipc
        ipc.engine_pid = fd_peer(conn.fileno()).pid
        while True:
            # The lease by its descriptor: what wait() registers of it anyway, and a type typeshed knows.
            lease = ipc.watched()
            ready = wait_for([conn] if lease is None else [conn, lease])
            if conn in ready:
                command = conn.recv()
                if not isinstance(command, Command):
                    raise EOFError(f"the server sent a {type(command).__name__}, not a Command")
                return command
            ipc.watch()


def _fixed_mmap_threshold() -> None:
    """glibc raises its mmap threshold after each large free, after which buffers of a bucket's size come
    from the heap; with gloo's threads coming and going with each weight-update group, the heap then
    fragments and the resident size creeps up (about 0.3 MB per group formed, measured). Keeping the
    threshold at glibc's initial 128 KiB maps large buffers and gives them back whole."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _loopback_store(port: int, rank: int, size: int, timeout: timedelta) -> dist.TCPStore:
    """The store of the engine's own TP group, reachable on loopback only: rank 0 hands torch a socket it
    bound to 127.0.0.1 (torch's own listener takes every interface), the other ranks connect to it."""
    if rank != 0:
        return tcp_store("127.0.0.1", port, is_master=False, world_size=size, timeout=timeout)
    listener = socket.create_server(("127.0.0.1", port), backlog=max(size, 8))
    return dist.TCPStore("127.0.0.1", port, size, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def worker_main(rank, size, model_dir, port, backend, device, dtype, conn, rollback=True,
                gloo_interface: str | None = None, ep: int = 1, checks: LoadChecks = DEFAULT_CHECKS,
                worker_type: type[Worker] = Worker) -> None:
    """``gloo_interface``: where gloo's listeners go (``GLOO_SOCKET_IFNAME``, unless the user set it): the
    interface of the engine's HTTP address. ``ep``: the engine's expert parallelism (:class:`Worker`). ``checks``:
    what the values of an update are checked for (:class:`~weightstream.receiver.values.LoadChecks`).
    ``worker_type``: the :class:`Worker` (or a subclass of it) that serves the commands."""
    die_with_parent()  # the kernel ends this worker when the engine's main process dies, however it dies
    _fixed_mmap_threshold()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if gloo_interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", gloo_interface)
    torch.set_num_threads(1)
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        timeout = timedelta(seconds=120)
        store = _loopback_store(port, rank, size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        worker = worker_type(rank, size, model_dir, torch.device(device), dtype_from_name(dtype), ep)
        worker.model.rollback = rollback
        worker.session.checks = checks
        conn.send(Reply(START_ID, Outcome.DONE, "ready"))
    except BaseException:  # noqa: BLE001
        conn.send(Reply(START_ID, Outcome.FAILED, traceback.format_exc()))
        return
    _serve(worker, conn)
    worker.groups.leave_all()
    dist.destroy_process_group()


def _serve(worker: Worker, conn: Connection) -> None:
    """Run the server's commands until it says ``shutdown`` (or its end of the pipe closes), answering each with
    one :class:`Reply` that carries the command's id."""
    handlers = worker.handlers()
    while True:
        start = time.perf_counter()
        try:
            command = worker.next_command(conn)
        except EOFError:
            return
        if worker.session.open:
            worker.clock.add("idle", time.perf_counter() - start)
        if isinstance(command.request, Shutdown):
            conn.send(Reply(command.id, Outcome.DONE, "bye"))
            return
        conn.send(_run(worker, handlers, command))


def _run(worker: Worker, handlers: dict[type, Callable[[Any], Any]], command: Command) -> Reply:
    """One command's reply: what it returned, or why it failed or stopped at its deadline."""
    run = handlers.get(type(command.request))
    if run is None:
        known = ", ".join(sorted(t.__name__ for t in handlers))
        return Reply(command.id, Outcome.FAILED,
                     f"unknown request {type(command.request).__name__} (known: {known})")
    worker.deadline = command.deadline
    try:
        return Reply(command.id, Outcome.DONE, run(command.request))
    except OutOfTime as exc:
        return Reply(command.id, Outcome.OUT_OF_TIME, str(exc))
    except BaseException as exc:  # noqa: BLE001 — reported to the server, the worker lives on
        return Reply(command.id, Outcome.FAILED, f"{type(exc).__name__}: {exc}")
    finally:
        worker.deadline = None
