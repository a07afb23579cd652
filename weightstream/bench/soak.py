"""The soak: many consecutive updates through one :class:`~weightstream.update.WeightSync` into one
reference engine running as its own service, proving that nothing is lost and nothing leaks.

The trainer (a Megatron-Core model in this process) alternates between two sets of weights on every
update and switches transport every ``switch_every`` updates (so each transport carries both sets,
and the sinks are switched again and again). Checksums are on. Every
``check_every`` updates the engine's logits are compared with those of the HF model holding the
weights just sent. Every ``sample_every`` updates the resources of the trainer and of the engine
(its main process and its workers) are sampled: resident memory, open file descriptors, threads, and
the entries of ``/dev/shm``. Growth is measured from the end of the warm-up to the end.

The engine is asked for its logits once before the first update: what its first such request starts
once (the worker's first forward pass, and the thread and socket through which multiprocessing hands
a tensor to the server) is then paid before any sample, not read as growth wherever the first check
falls. Each sample also counts the weight-update groups the trainer has formed (``trainer_groups``): the
broadcast and P2P sinks hand one group over to each other where it is the same (trainer and engine at
TP 1), so switching between them forms none; a group formed again on each switch is what grew the
trainer's heap before.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from weightstream.common.progress import Progress
    from weightstream.engines import ReferenceEngine
    from weightstream.update import WeightSync

__all__ = ["INPUT_IDS", "process_resources", "shm_entries", "SoakReport", "EngineService", "run_soak"]


INPUT_IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433], [999, 0, 1, 2, 500, 501, 77, 88, 99, 111]]


def process_resources(pids: list[int]) -> dict[str, float]:
    """Resident memory (MB), open file descriptors and threads, summed over ``pids``."""
    rss_kb = fds = threads = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        rss_kb += int(status["VmRSS"].split()[0])
        threads += int(status["Threads"])
        fds += len(os.listdir(f"/proc/{pid}/fd"))
    return {"rss_mb": rss_kb / 1024, "fds": fds, "threads": threads}


def shm_entries() -> int:
    return len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0


@dataclass
class SoakReport:
    updates: int
    transports: list[str]
    preset: str
    engine_tp: int
    bucket_bytes: int
    seconds_total: float = 0.0
    seconds_per_update: dict[str, dict[str, float]] = field(default_factory=dict)
    logits_checks: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    warmup: int = 0
    growth: dict[str, float] = field(default_factory=dict)
    growth_second_half: dict[str, float] = field(default_factory=dict)
    groups_formed: int = 0  # weight-update groups the trainer formed during the soak
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and all(c["ok"] for c in self.logits_checks)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def render(self) -> str:
        lines = [(f"soak: {self.updates} updates of {self.preset} into a reference engine (TP {self.engine_tp}), "
                  f"transports {'/'.join(self.transports)}, {self.bucket_bytes >> 10} KiB buckets, checksums on: "
                  f"{self.seconds_total:.1f} s")]
        for kind, s in self.seconds_per_update.items():
            lines.append(f"  {kind:9s} {int(s['count']):5d} updates  median {s['median'] * 1e3:7.1f} ms  "
                         f"p99 {s['p99'] * 1e3:7.1f} ms  max {s['max'] * 1e3:7.1f} ms")
        passed = sum(c["ok"] for c in self.logits_checks)
        worst = max((c["max_abs_diff"] for c in self.logits_checks), default=0.0)
        lines.append(f"  engine logits checked {len(self.logits_checks)} times: {passed} equal to HF's "
                     f"(worst max |diff| {worst:.1e})")
        lines.append(f"  weight-update groups formed by the trainer: {self.groups_formed}")
        g = self.growth
        if not g:
            lines.append(f"  growth not measured: no resource sample falls after a warm-up of {self.warmup} "
                         f"updates and before the last of {self.updates} (run more updates, or sample more often)")
        else:
            lines.append(f"  growth after warm-up ({self.warmup} updates): "
                         f"trainer RSS {g['trainer_rss_mb']:+.1f} MB, fds {g['trainer_fds']:+.0f}, threads "
                         f"{g['trainer_threads']:+.0f}; engine RSS {g['engine_rss_mb']:+.1f} MB, fds "
                         f"{g['engine_fds']:+.0f}, threads {g['engine_threads']:+.0f}; /dev/shm entries "
                         f"{g['shm']:+.0f}")
        h = self.growth_second_half
        if h:
            lines.append(f"  growth over the second half: trainer RSS {h['trainer_rss_mb']:+.1f} MB, engine RSS "
                         f"{h['engine_rss_mb']:+.1f} MB, fds {h['trainer_fds'] + h['engine_fds']:+.0f}, threads "
                         f"{h['trainer_threads'] + h['engine_threads']:+.0f}, /dev/shm {h['shm']:+.0f}")
        lines.extend(f"  FAILED: {f}" for f in self.failures)
        return "\n".join(lines)


class EngineService:
    """``weightstream engine`` in a process of its own (so that its resources are its own)."""

    def __init__(self, model_dir: str, tp: int, start_timeout_s: float = 300.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightstream.cli", "engine", "--hf", model_dir, "--tp", str(tp), "--port", "0"],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert self.proc.stdout is not None  # stdout=PIPE
        line = self.proc.stdout.readline()
        if "serving on" not in line:
            self.proc.kill()
            raise RuntimeError(f"the engine did not start (exit code {self.proc.wait(timeout=30)})")
        self.url = line.rsplit(" ", 1)[-1].strip()
        from weightstream.engines import ReferenceEngine

        self.pids = [self.proc.pid, *ReferenceEngine(self.url).server_info()["worker_pids"]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"count": len(values), "median": statistics.median(values), "mean": statistics.fmean(values),
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max": ordered[-1]}


def run_soak(updates: int = 1000, *, transports: tuple[str, ...] = ("broadcast", "ipc"), switch_every: int = 2,
             preset: str = "tiny-qwen3", engine_tp: int = 1, bucket_bytes: int = 256 << 10, check_every: int = 100,
             sample_every: int = 10, warmup: int | None = None, progress: Progress | None = None) -> SoakReport:
    """``updates`` consecutive updates of the ``preset`` model into a reference engine of TP ``engine_tp`` (see the
    module's doc); the report of what passed, what failed and what grew. ``progress``: where to report the
    phases and the updates done."""
    import torch.distributed as dist

    from weightstream.engines import ReferenceEngine
    from weightstream.models.presets import preset_config, save_random_checkpoint
    from weightstream.update import WeightSync

    torch.set_num_threads(1)
    warmup = warmup if warmup is not None else min(max(updates // 4, sample_every), 500)
    report = SoakReport(updates, list(transports), preset, engine_tp, bucket_bytes, warmup=warmup)
    schedule = _Schedule(updates, transports, switch_every, check_every, sample_every)
    cfg = preset_config(preset)
    say = progress.phase if progress is not None else _silent
    with tempfile.TemporaryDirectory(prefix="weightstream-soak-") as tmp:
        say(f"writing three random checkpoints of {preset}")
        sets = [save_random_checkpoint(cfg, os.path.join(tmp, name), seed=seed) for name, seed in (("a", 1), ("b", 2))]
        engine_dir = save_random_checkpoint(cfg, os.path.join(tmp, "engine"), seed=3)
        say("computing the HF model's logits for each set of weights")
        expected = _hf_logits(sets)
        say("building the trainer's Megatron-Core model")
        trainer = _start_trainer(cfg, sets)
        say(f"starting the reference engine (TP {engine_tp})")
        service = EngineService(engine_dir, engine_tp)
        engine = ReferenceEngine(service.url, timeout_s=60)
        engine.logits(INPUT_IDS)  # its one-off costs paid before the first sample (see the module's doc)
        probe = _Probe(engine, service, expected)
        times: dict[str, list[float]] = {t: [] for t in transports}
        start = time.perf_counter()
        say(f"{updates} updates")
        try:
            with WeightSync([service.url], transport=transports[0], bucket_bytes=bucket_bytes, checksums=True,
                            timeout_s=60) as sync:
                _run_updates(sync, trainer, probe, schedule, report, times, progress)
        except Exception as exc:  # noqa: BLE001 — the report says what failed
            report.failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            service.stop()
            dist.destroy_process_group()
        report.groups_formed = probe.groups_formed
        report.seconds_total = time.perf_counter() - start
        report.seconds_per_update = {k: _stats(v) for k, v in times.items() if v}
        _measure_growth(report, warmup)
    return report


@dataclass
class _Schedule:
    """How many updates, the transport of each, and after which updates the soak checks and samples."""

    updates: int
    transports: tuple[str, ...]
    switch_every: int
    check_every: int
    sample_every: int

    def transport(self, i: int) -> str:
        return self.transports[(i // self.switch_every) % len(self.transports)]

    def checks_after(self, done: int) -> bool:
        return done % self.check_every == 0 or done == self.updates

    def samples_after(self, done: int) -> bool:
        return done % self.sample_every == 0 or done == self.updates


@dataclass
class _Trainer:
    """The trainer's Megatron-Core model and the two sets of weights it alternates between."""

    cfg: Any
    chunks: list[torch.nn.Module]
    params: list[torch.nn.Parameter]
    snapshots: list[list[torch.Tensor]]

    def hold(self, which: int) -> None:
        """Put weight set ``which`` into the model."""
        with torch.no_grad():
            for p, v in zip(self.params, self.snapshots[which], strict=True):
                p.copy_(v)


@dataclass
class _Probe:
    """What the soak watches: the engine's logits and the resources of the trainer and of the engine."""

    engine: ReferenceEngine
    service: EngineService
    expected: list[torch.Tensor]  # the HF model's logits for each set of weights
    groups_formed: int = 0  # weight-update groups the trainer's updates formed so far

    def check_logits(self, report: SoakReport, done: int, which: int, kind: str) -> None:
        """Compare the engine's logits with those of the HF model holding weight set ``which``."""
        got = self.engine.logits(INPUT_IDS)
        diff = float((got - self.expected[which]).abs().max())
        report.logits_checks.append({"update": done, "weights": "ab"[which], "transport": kind,
                                     "max_abs_diff": diff, "ok": diff <= 1e-4})

    def sample(self, report: SoakReport, done: int) -> None:
        """Record the resources of both sides, /dev/shm's entries and the groups formed so far."""
        trainer = process_resources([os.getpid()])
        eng = process_resources(self.service.pids)
        report.samples.append({"update": done, "shm": shm_entries(),
                               "trainer_groups": self.groups_formed,
                               **{f"trainer_{k}": v for k, v in trainer.items()},
                               **{f"engine_{k}": v for k, v in eng.items()}})


def _hf_logits(sets: list[str]) -> list[torch.Tensor]:
    """The logits the HF model of each checkpoint gives for :data:`INPUT_IDS`."""
    from transformers import AutoModelForCausalLM

    expected = []
    for d in sets:
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            expected.append(hf(torch.tensor(INPUT_IDS)).logits.float())
        del hf
    return expected


def _start_trainer(cfg: Any, sets: list[str]) -> _Trainer:
    """A one-rank ``torch.distributed`` job in this process and its Megatron-Core model, with the weights of
    each checkpoint of ``sets`` kept aside (the model holds the last)."""
    import torch.distributed as dist

    from weightstream.checks.megatron_models import build_gpt_model, initialize_parallel, load_hf_weights
    from weightstream.common.hf_files import CheckpointReader
    from weightstream.common.processes import free_port
    from weightstream.wire.groups import tcp_store

    port = free_port()
    dist.init_process_group("gloo", store=tcp_store("127.0.0.1", port, is_master=True, world_size=1), rank=0,
                            world_size=1)
    initialize_parallel(1, 1)
    chunks = build_gpt_model(cfg)
    snapshots = []
    for d in sets:
        with CheckpointReader(d) as reader:
            load_hf_weights(chunks, cfg, reader)
        snapshots.append([p.detach().clone() for c in chunks for p in c.parameters()])
    params = [p for c in chunks for p in c.parameters()]
    return _Trainer(cfg, chunks, params, snapshots)


def _silent(text: str) -> None:
    """Where a soak without ``progress`` reports its phases: nowhere."""


def _run_updates(sync: WeightSync, trainer: _Trainer, probe: _Probe, schedule: _Schedule, report: SoakReport,
                 times: dict[str, list[float]], progress: Progress | None) -> None:
    """The updates, alternating the two sets of weights and switching transport as ``schedule`` says; each one
    timed (``times``, by transport), and checked and sampled when due."""
    for i in range(schedule.updates):
        which = i % 2
        kind = schedule.transport(i)
        trainer.hold(which)
        sync.transport = kind
        t = time.perf_counter()
        rep = sync.update(trainer.chunks, trainer.cfg, weight_version=f"soak-{i}")
        times[kind].append(time.perf_counter() - t)
        probe.groups_formed += rep.formed_group
        if rep.transport != kind or rep.weight_version != f"soak-{i}":
            report.failures.append(f"update {i}: {rep.summary()}")
        done = i + 1
        if schedule.checks_after(done):
            probe.check_logits(report, done, which, kind)
        if schedule.samples_after(done):
            probe.sample(report, done)
        if progress is not None:
            progress.count(done, schedule.updates, "update")


def _measure_growth(report: SoakReport, warmup: int) -> None:
    """The growth of every sampled figure from the end of the warm-up, and over the second half, to the end: the
    end is the lesser of the last two samples (a descriptor or thread that happens to be open at one sample, a
    request being served, is not growth; a leak, which grows with the updates between two samples, shows in
    both)."""
    base = next((s for s in report.samples if s["update"] >= warmup), None)
    if base is not None and base["update"] < report.samples[-1]["update"]:
        report.warmup = base["update"]  # the window starts at the first sample after the warm-up
        ends = report.samples[-2:]
        last = {k: min(s[k] for s in ends) for k in ends[-1]}
        report.growth = {k: last[k] - base[k] for k in base if k != "update"}
        mid = next(s for s in report.samples if s["update"] >= report.updates // 2)
        report.growth_second_half = {k: last[k] - mid[k] for k in mid if k != "update"}
