"""Megatron-Core checkpoints written the way training jobs write them, for the checkpoint source's tests.

- ``torch_dist``: Megatron-Core's own ``dist_checkpointing.save`` of the model's ``sharded_state_dict``,
  in the dictionary Megatron-LM saves (``model`` or ``model0``, ``model1``, ... per VPP chunk, ``args``,
  ``iteration``, ``checkpoint_version``), into ``iter_{:07d}/``, with ``latest_checkpointed_iteration.txt``.
- ``legacy``: Megatron-LM's ``ckpt_format=torch`` layout, ``iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/
  model_optim_rng.pt`` (the PP part only when PP > 1, the EP part only when EP > 1; written by the ranks of
  the first data-parallel replica), holding ``state_dict_for_save_checkpoint()`` of each chunk.
"""

from __future__ import annotations

import os
from argparse import Namespace
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tests.checks import INPUT_IDS
from tests.workers import Case, _build
from weightstream.models.megatron import megatron_logits


@contextmanager
def _cpu_save_shims():
    """Megatron's distributed save synchronises CUDA and broadcasts a flag on the current CUDA device."""
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def _args(case: Case, cfg) -> Namespace:
    layout = case.layout
    return Namespace(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                     virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
                     expert_tensor_parallel_size=layout.etp or layout.tp, num_layers=cfg.num_hidden_layers,
                     ckpt_format="torch")


def _tracker(root: str, iteration: int) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def save_torch_dist(chunks, args: Namespace, root: str, iteration: int) -> None:
    from megatron.core import dist_checkpointing

    directory = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    for i, chunk in enumerate(chunks):
        state["model" if len(chunks) == 1 else f"model{i}"] = chunk.sharded_state_dict(metadata=metadata)
    with _cpu_save_shims():
        dist_checkpointing.save(state, directory, content_metadata=metadata)
    _tracker(root, iteration)


def save_legacy(chunks, args: Namespace, root: str, iteration: int) -> None:
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep = ps.get_expert_model_parallel_rank()
    name = f"mp_rank_{tp:02d}"
    if args.pipeline_model_parallel_size > 1:
        name += f"_{pp:03d}"
    if args.expert_model_parallel_size > 1:
        name += f"_{ep:03d}"
    if ps.get_expert_data_parallel_rank() == 0:
        directory = os.path.join(root, f"iter_{iteration:07d}", name)
        os.makedirs(directory, exist_ok=True)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
        for i, chunk in enumerate(chunks):
            state["model" if len(chunks) == 1 else f"model{i}"] = chunk.state_dict_for_save_checkpoint()
        torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
    _tracker(root, iteration)


def run_saves(cases: list[tuple[Case, str]], iteration: int = 7) -> list[dict]:
    """For each (case, root): build the Megatron model from the case's HF checkpoint, take its logits, and
    save it in both formats under ``root/torch_dist`` and ``root/legacy``."""
    out = []
    for case, root in cases:
        cfg, chunks = _build(case)
        logits = megatron_logits(chunks, torch.tensor(INPUT_IDS), cfg.vocab_size)
        args = _args(case, cfg)
        save_torch_dist(chunks, args, os.path.join(root, "torch_dist"), iteration)
        save_legacy(chunks, args, os.path.join(root, "legacy"), iteration)
        out.append({"logits": logits})
    return out
