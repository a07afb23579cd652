"""Trainers for delta updates: a transformers model with Adam on fp32 masters (in the test process), and a
Megatron-Core trainer job (``weightstream.launch``) that updates a reference engine with delta updates."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.helpers.workers import Case, _build
from weightstream.streaming.stream import stream_hf_weights


class HFAdamTrainer:
    """Adam on fp32 master weights of a transformers model of ``config``; ``model`` holds them in bf16, as a
    trainer streams them: at a small learning rate few bf16 words change per step."""

    def __init__(self, config, seed: int, lr: float):
        from weightstream.models.presets import random_hf_model

        self.config = config
        self.master = random_hf_model(config, seed=seed)
        self.model = copy.deepcopy(self.master).to(torch.bfloat16)
        self.opt = torch.optim.Adam(self.master.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        ids = torch.randint(0, self.config.vocab_size, (2, 16), generator=self.gen)
        self.master(ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for kept, master in zip(self.model.parameters(), self.master.parameters(), strict=True):
                kept.copy_(master)

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


class SeededAdam:
    """Adam over fp32 master copies of ``chunks``' parameters, each step's gradient of every master seeded by the
    step (the same on every rank, so that what Megatron replicates over TP stays equal), the masters copied into
    the model after it."""

    def __init__(self, chunks, lr: float):
        self.params = [p for c in chunks for p in c.parameters()]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.Adam(self.masters, lr=lr)

    def step(self, step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        for m in self.masters:
            m.grad = torch.randn(m.shape, generator=gen)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)


def run_delta_updates(case: Case, url: str | list[str], steps: int, lr: float, transport: str = "auto") -> dict:
    """Build the trainer (its weights in ``case.dtype``), keep fp32 master copies with Adam over them, and per
    step: one Adam step (the gradient of each master seeded by the step, the same on every rank, so that what
    Megatron replicates over TP stays equal), the masters copied into the model, one update of a kept
    ``WeightSync(delta=True)`` into the engine(s) at ``url``. Returns every update's report and, on rank 0, the
    HF tensors the trainer streams after the last step."""
    from weightstream.update import WeightSync

    cfg, chunks = _build(case)
    adam = SeededAdam(chunks, lr)
    reports = []
    urls = [url] if isinstance(url, str) else url
    with WeightSync(urls, delta=True, bucket_bytes=case.bucket_bytes, transport=transport) as sync:
        for step in range(steps):
            if step:
                adam.step(step)
            reports.append(sync.update(chunks, cfg, weight_version=f"v{step}"))
    tensors = {n: t.clone() for b in stream_hf_weights(chunks, cfg, bucket_bytes=case.bucket_bytes)
               for n, t in b.named_tensors()}
    return {"reports": reports, "tensors": tensors if dist.get_rank() == 0 else None}
