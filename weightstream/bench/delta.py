"""``weightstream bench --delta``: delta updates measured on real optimizer steps, against full updates of the
same weights in the same run.

The trainer is the preset's Megatron-Core model in bf16 with fp32 master weights (on its device, or in host
memory with ``masters="host"`` where the device cannot hold them and Adam's state), Adam over the masters (its
states in host memory with ``optimizer="host"``, each parameter stepped on the device in turn), the
masters copied into the model after each step; each step's gradient is that of the model's own language-model
loss on a random batch (forward and backward through Megatron). One ``WeightSync(delta=True)`` into a reference
engine makes, in order: ``prepare()`` (the plan, the group, on a GPU the copy and word kernels compiled: timed
apart), the first update (full, cold); ``repeats`` full updates of the same weights, warm
(forced full); then per learning rate, ``steps`` times: one optimizer step, one update (deltas). Each update's
report gives the share of words changed, the bytes on the wire, its encodings, its time and phases, and the
check of its bytes (every engine rank's checksum of every bucket against the trainer's). The row's check: every
update checked, and the engine's logits after the last one equal to the Megatron model's forward (within the
tolerance of :func:`~weightstream.bench.speed.logits_check`). The ceiling of the same run: a device copy of the
full update's bytes (IPC) or a plain broadcast of them (broadcast). ``wire="socket"``: as
:mod:`weightstream.bench.speed`'s ``--wire socket``, every process on NCCL's socket transport over loopback.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from weightstream.bench.speed import (
    IDS,
    _engine_devices,
    _timed,
    _trainer,
    bench_config,
    broadcast_ceiling,
    copy_ceiling,
    logits_check,
    on_wire,
    send_recv_ceiling,
    serving,
    wire_problems,
)
from weightstream.sinks.delta import DeltaTracker

__all__ = [
    "DELTA_TRANSPORTS", "SEQ", "BATCH", "DeltaStep", "DeltaBenchResult", "delta_job", "run_delta_bench",
    "write_delta_json"
]


DELTA_TRANSPORTS = ("broadcast", "p2p", "ipc")
SEQ = 64  # tokens per sequence of a training batch
BATCH = 2


@dataclass
class DeltaStep:
    """One update of the run: full (why) or deltas, what it sent and how long it took."""

    lr: float | None  # the learning rate of the step before it (None: no step, the same weights again)
    full: bool
    reason: str
    seconds: float
    changed_fraction: float
    wire_bytes: int
    encodings: dict[str, int]
    checked: bool
    phases: dict[str, float]
    peak_extra_bytes: int | None  # the device memory the update added at its peak (None on a CPU)


@dataclass
class DeltaBenchResult:
    preset: str
    transport: str
    device: str
    dtype: str
    bucket_bytes: int
    masters: str
    snapshot: str
    optimizer: str = "device"  # where Adam's states are kept ("host": each parameter stepped on the device in turn)
    wire: str = "default"  # speed.WIRES
    bytes: int = 0  # of a full update
    buckets: int = 0
    snapshot_bytes: int = 0  # what the sender kept to compute deltas
    prepare_s: float = 0.0  # WeightSync.prepare() before the first update
    updates: list[DeltaStep] = field(default_factory=list)
    ceiling_s: float = 0.0
    ceiling: str = ""
    check: str = ""
    check_ok: bool | None = None

    @property
    def failed(self) -> bool:
        return self.check_ok is not True

    @property
    def full_s(self) -> float:
        """The best warm full update (the first update, cold, left out where there are others)."""
        full = [u.seconds for u in self.updates if u.full]
        return min(full[1:] or full)

    def rows(self) -> list[tuple[float, list[DeltaStep]]]:
        """The delta updates, by learning rate, in the order run."""
        out: dict[float, list[DeltaStep]] = {}
        for u in self.updates:
            if u.lr is not None:
                out.setdefault(u.lr, []).append(u)
        return list(out.items())

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(full_s=self.full_s)
        return d

    def render(self) -> str:
        lines = [
            f"weightstream bench --delta: {self.preset}, {self.transport}, {self.dtype}, {self.device}, "
            f"buckets of {self.bucket_bytes / 2**20:g} MiB; fp32 masters on the {self.masters}, "
            f"Adam's states on the {self.optimizer}, snapshot on the {self.snapshot}"
            + (", NCCL socket transport over loopback" if self.wire == "socket" else ""),
            f"  full update       {self.full_s * 1e3:9.1f} ms   {self.bytes / 1e6:.1f} MB, {self.buckets} buckets "
            f"(best warm; ceiling {self.ceiling_s * 1e3:.1f} ms: {self.ceiling}; "
            f"ratio {self.full_s / self.ceiling_s if self.ceiling_s else float('nan'):.2f}x)",
            f"  snapshot          {self.snapshot_bytes / 1e6:9.1f} MB kept by the sender",
            f"  prepare()         {self.prepare_s * 1e3:9.1f} ms before the first update",
        ]
        for lr, steps in self.rows():
            for k, u in enumerate(steps):
                what = "full" if u.full else f"{u.changed_fraction:7.3%} changed"
                enc = ", ".join(f"{n} {e}" for e, n in sorted(u.encodings.items()))
                lines.append(
                    f"  lr {lr:g} step {k + 1}: {what}, {u.wire_bytes / 1e6:8.2f} MB on the wire "
                    f"({u.wire_bytes / max(self.bytes, 1):.2%} of full), {u.seconds * 1e3:8.1f} ms "
                    f"({u.seconds / self.full_s:.2f}x full), {'checked' if u.checked else 'NOT CHECKED'}; "
                    f"buckets: {enc}" + ("" if not u.full else f" ({u.reason})"))
                peak = "" if u.peak_extra_bytes is None else f"; peak extra {u.peak_extra_bytes / 2**20:.1f} MiB"
                lines.append("      phases: " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in u.phases.items())
                             + peak)
        verdict = {True: "passed", False: "FAILED", None: "not run"}[self.check_ok]
        lines.append(f"  check ({verdict}): {self.check}")
        return "\n".join(lines)


class _Adam:
    """fp32 master weights of ``chunks``' parameters (on ``where``: "device" or "host") with Adam over them; a
    step copies them into the model's (bf16) parameters. ``states="host"``: Adam's two states of each parameter
    are kept in host memory (pinned), and each parameter steps in turn on the model's device, its states (and its
    masters where they are on the host) brought there and back: the device then holds one parameter's states, fp32
    gradient (and masters) at a time, not the model's (three times its fp32 masters; four with them)."""

    def __init__(self, chunks: list[nn.Module], where: str, lr: float, states: str = "device"):
        self.params = [p for c in chunks for p in c.parameters()]
        host = where == "host" and self.params[0].is_cuda
        self.masters = [p.detach().float().to("cpu" if host else p.device).clone() for p in self.params]
        if host:
            self.masters = [m.pin_memory() for m in self.masters]
        self.states_on_host = states == "host"
        groups = [[m] for m in self.masters] if self.states_on_host else [self.masters]
        self.opts = [torch.optim.Adam(g, lr=lr) for g in groups]
        self.kept: dict[int, dict[str, torch.Tensor]] = {}  # per parameter: its states' pinned host tensors

    def set_lr(self, lr: float) -> None:
        for opt in self.opts:
            for group in opt.param_groups:
                group["lr"] = lr

    def step(self, chunks: list[nn.Module], vocab_size: int, gen: torch.Generator) -> float:
        """One step on the loss of a random batch: its loss."""
        loss = _loss(chunks, vocab_size, gen)
        loss.backward()
        with torch.no_grad():
            if self.states_on_host:
                self._step_each()
            else:
                self._step_all()
        return float(loss)

    def _step_all(self) -> None:
        """Every parameter's fp32 gradient made, one Adam step over all, every masters copied into the model."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = _fp32_grad(p, m)
            p.grad = None
        self.opts[0].step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)
            m.grad = None

    def _step_each(self) -> None:
        """Parameter by parameter on the model's device: its masters and states brought there, its fp32 gradient,
        its step, the masters copied into the model, then masters and states back into their host tensors."""
        for k, (p, m, opt) in enumerate(zip(self.params, self.masters, self.opts, strict=True)):
            held, moved = m.data, m.device != p.device
            if moved:
                m.data = held.to(p.device, non_blocking=True)
            m.grad = _fp32_grad(p, m)
            p.grad = None
            state = opt.state.get(m, {})
            for name in _STATES:
                if name in state:
                    state[name] = state[name].to(p.device, non_blocking=True)
            opt.step()
            p.copy_(m)
            m.grad = None
            if moved:
                held.copy_(m.data)
                m.data = held
            self._keep_on_host(k, opt.state[m])

    def _keep_on_host(self, k: int, state: dict) -> None:
        kept = self.kept.setdefault(k, {})
        for name in _STATES:
            t = state[name]
            if t.device.type == "cpu":
                continue
            host = kept.get(name)
            if host is None:
                host = kept[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t)
            state[name] = host


_STATES = ("exp_avg", "exp_avg_sq")  # Adam's states of a parameter (torch.optim.Adam's names)


def _fp32_grad(p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (p.grad if p.grad is not None else torch.zeros_like(p)).to(m.device, torch.float32)


def _loss(chunks: list[nn.Module], vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """The mean language-model loss of the (one-stage) Megatron model on a random batch, its graph kept."""
    from weightstream.checks.megatron_models import forward_shims
    from weightstream.sources.megatron import unwrap

    (model,) = [unwrap(c) for c in chunks]
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab_size, (BATCH, SEQ + 1), generator=gen).to(device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device), diagonal=1)
    model.train()
    with forward_shims():
        return model(inputs, position_ids, mask, labels=labels).float().mean()


def delta_job(cfg_dir: str, url: str, transport: str, bucket_bytes: int, dtype: str, lrs: list[float],
              steps: int, repeats: int, masters: str, snapshot: str, tp: int = 1, optimizer: str = "device") -> dict:
    """Trainer rank (TP ``tp``): the updates of the run (module docstring), each as :class:`DeltaStep`
    fields; the Megatron model's logits after the last (or why its forward failed)."""
    from weightstream.checks.megatron_models import megatron_logits
    from weightstream.models.spec import load_hf_config
    from weightstream.update import WeightSync

    cfg = load_hf_config(cfg_dir)
    chunks, device = _trainer(cfg, dtype, tp)
    adam = _Adam(chunks, masters, lrs[0], optimizer)
    gen = torch.Generator().manual_seed(0)
    updates: list[dict] = []

    def update(lr: float | None) -> None:
        version = str(len(updates))
        ((seconds, report),), peak = _timed(device, 1, lambda: sync.update(chunks, cfg, weight_version=version))
        d = report.delta
        if dist.is_initialized() and dist.get_rank() != 0:  # trainer rank 0 decides and checks; others: their bytes
            updates.append({"bytes": report.bytes, "buckets": report.buckets})
            return
        if d is None:
            raise RuntimeError("a delta-mode update reported no delta")
        updates.append({"lr": lr, "full": d.full, "reason": d.reason, "seconds": seconds,
                        "changed_fraction": d.changed_fraction, "wire_bytes": d.wire_bytes,
                        "encodings": dict(d.encodings), "checked": d.checked,
                        "phases": {k: v for k, v in report.seconds.items() if k != "total"},
                        "peak_extra_bytes": peak, "bytes": report.bytes, "buckets": report.buckets,
                        "snapshot_bytes": d.snapshot_bytes})

    with WeightSync([url], transport=transport, bucket_bytes=bucket_bytes, timeout_s=300, delta=True,
                    snapshot=snapshot, reuse_buffers=True) as sync:
        tracker = _tracker(sync.delta)
        ((prepare_s, _),), _ = _timed(device, 1, lambda: sync.prepare(chunks, cfg))
        update(None)
        for _ in range(repeats):
            tracker.force_full("a full update of the same weights, timed to compare with")
            update(None)
        for lr in lrs:
            adam.set_lr(lr)
            for _ in range(steps):
                adam.step(chunks, cfg.vocab_size, gen)
                update(lr)
    logits: torch.Tensor | str
    try:
        logits = megatron_logits(chunks, torch.tensor(IDS), cfg.vocab_size).float().cpu()
    except Exception as exc:  # noqa: BLE001 -- the row reports it and fails
        logits = f"the Megatron model's own forward failed: {type(exc).__name__}: {exc}"
    return {"device": str(device), "updates": updates, "logits": logits, "prepare_s": prepare_s}


def _tracker(tracker: DeltaTracker | None) -> DeltaTracker:
    if tracker is None:
        raise RuntimeError("WeightSync(delta=True) made no delta tracker")
    return tracker


def run_delta_bench(preset: str, transport: str, *, tiny: bool = False, dtype: str = "bfloat16",
                    bucket_bytes: int = 512 << 20, lrs: tuple[float, ...] = (1e-6, 1e-5), steps: int = 3,
                    repeats: int = 2, masters: str = "device", snapshot: str = "device",
                    engine_device: str | None = None, tp: int = 1, optimizer: str = "device",
                    wire: str = "default") -> DeltaBenchResult:
    """One ``bench --delta`` row (module docstring)."""
    problems = []
    if transport not in DELTA_TRANSPORTS:
        problems.append(f"transport must be one of {DELTA_TRANSPORTS}, got {transport!r}")
    if {masters, snapshot, optimizer} - {"device", "host"}:
        problems.append(f"masters, snapshot and the optimizer's states are kept on 'device' or 'host', got "
                        f"{masters!r}, {snapshot!r}, {optimizer!r}")
    problems += wire_problems(wire, transport)
    if steps < 1 or not lrs or any(lr <= 0 for lr in lrs):
        problems.append(f"at least one step and positive learning rates, got steps {steps}, lrs {list(lrs)}")
    if problems:
        raise ValueError("bench --delta: " + "; ".join(problems))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    cfg = bench_config(preset, tiny, dtype)
    res = DeltaBenchResult(preset + (" (tiny widths)" if tiny else ""), transport, "", dtype, bucket_bytes,
                           masters, snapshot, optimizer, wire)
    with on_wire(wire):
        return _run_delta(res, cfg, transport, backend, lrs, steps, repeats, engine_device, tp)


def _run_delta(res: DeltaBenchResult, cfg, transport: str, backend: str, lrs: tuple[float, ...],
               steps: int, repeats: int, engine_device: str | None, tp: int) -> DeltaBenchResult:
    """The row's engine and trainer ranks, its check and its ceiling (:func:`run_delta_bench`)."""
    from weightstream.launch import launch

    dtype, bucket_bytes = res.dtype, res.bucket_bytes
    engine_tp = 1 if transport == "broadcast" else tp
    devices = _engine_devices(engine_device, transport, tp, engine_tp, 1)
    with serving(cfg, devices, engine_tp, dtype) as (tmp, (url,)):
        ranks = launch(tp, delta_job, tmp, url, transport, bucket_bytes, dtype, list(lrs), steps, repeats,
                       res.masters, res.snapshot, tp, res.optimizer, backend=backend, timeout_s=3600)
        r = ranks[0]
        text, ok = logits_check(url, r["logits"], dtype)
    res.device = f"trainer {r['device']}, engine {devices[0]}"
    res.prepare_s = r["prepare_s"]
    res.updates = [DeltaStep(**{k: u[k] for k in DeltaStep.__dataclass_fields__}) for u in r["updates"]]
    last = r["updates"][-1]
    res.bytes, res.buckets, res.snapshot_bytes = last["bytes"], last["buckets"], last["snapshot_bytes"]
    unchecked = [k for k, u in enumerate(res.updates) if not u.checked]
    full_after_steps = [k for k, u in enumerate(res.updates) if u.lr is not None and u.full]
    res.check = (f"{len(res.updates) - len(unchecked)} of {len(res.updates)} updates checked (every engine rank's "
                 f"checksum of every bucket equal to the trainer's); {text}")
    if full_after_steps:
        res.check += f"; updates {full_after_steps} after a step went full"
    res.check_ok = ok and not unchecked and not full_after_steps
    if transport == "ipc":
        res.ceiling_s = copy_ceiling(res.bytes, bucket_bytes, torch.device(devices[0].split(",")[0]), repeats)
        res.ceiling = "device copy of a full update's bytes"
    elif transport == "p2p":
        per_rank = [x["updates"][-1]["bytes"] for x in ranks]
        res.bytes = sum(per_rank)
        res.ceiling_s, res.ceiling = send_recv_ceiling(per_rank, bucket_bytes, repeats, backend)
    else:
        res.ceiling_s, res.ceiling = broadcast_ceiling(res.bytes, engine_tp, bucket_bytes, repeats, backend)
    return res


def write_delta_json(results: list[DeltaBenchResult], path: str) -> None:
    with open(path, "w") as f:
        json.dump([r.as_dict() for r in results], f, indent=1)
