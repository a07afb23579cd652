"""Megatron-Core checkpoints written the way training jobs write them, for the checkpoint source's tests.

- ``torch_dist``: Megatron-Core's own ``dist_checkpointing.save`` of the model's ``sharded_state_dict``,
  in the dictionary Megatron-LM saves (``model`` or ``model0``, ``model1``, ... per VPP chunk, ``args``,
  ``iteration``, ``checkpoint_version``), into ``iter_{:07d}/``, with ``latest_checkpointed_iteration.txt``.
- ``legacy``: Megatron-LM's ``ckpt_format=torch`` layout, ``iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/
  model_optim_rng.pt`` (the PP part only when PP > 1, the EP part only when EP > 1; written by the ranks of
  the first data-parallel replica), holding ``state_dict_for_save_checkpoint()`` of each chunk; with
  ``training_state``, also what Megatron-LM's ``generate_state_dict`` adds (optimizer and LR-scheduler state,
  the RNG states, numpy's among them, and ``args`` holding the enums and dtypes Megatron-LM's arguments hold).
"""

from __future__ import annotations

import os
from argparse import Namespace
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tests.helpers.checks import INPUT_IDS
from tests.helpers.workers import Case, _build
from weightstream.checks.megatron_models import megatron_logits


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


def _training_state(chunks, args: Namespace) -> dict:
    """What Megatron-LM's save_checkpoint puts in a legacy rank file besides the model (generate_state_dict)."""
    import random
    import signal

    import numpy as np
    from megatron.core import tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.enums import AttnBackend

    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-4)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # Adam's state for every parameter; a zero gradient leaves the weights as they are
    for p in params:
        p.grad = None
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-4, min_lr=1e-5, lr_warmup_steps=10,
                                        lr_decay_steps=100, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=100, wd_incr_style="constant")
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),  # no CUDA here
           "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    args = Namespace(**vars(args), params_dtype=torch.float32, attention_backend=AttnBackend.auto,
                     exit_signal=signal.SIGTERM, model_type=ModelType.encoder_or_decoder)
    return {"args": args, "optimizer": {"optimizer": optimizer.state_dict()},
            "opt_param_scheduler": scheduler.state_dict(), "rng_state": [rng],
            "num_floating_point_operations_so_far": 0.0}


def save_legacy(chunks, args: Namespace, root: str, iteration: int, training_state: bool = False) -> None:
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
        if training_state:
            state.update(_training_state(chunks, args))
        torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
    _tracker(root, iteration)


def run_saves(cases: list[tuple[Case, str]], iteration: int = 7, training_state: bool = False) -> list[dict]:
    """For each (case, root): build the Megatron model from the case's HF checkpoint, take its logits, and
    save it in both formats under ``root/torch_dist`` and ``root/legacy`` (``training_state``: the legacy
    files with Megatron-LM's optimizer, scheduler and RNG state too)."""
    out = []
    for case, root in cases:
        cfg, chunks = _build(case)
        logits = megatron_logits(chunks, torch.tensor(INPUT_IDS), cfg.vocab_size)
        args = _args(case, cfg)
        save_torch_dist(chunks, args, os.path.join(root, "torch_dist"), iteration)
        save_legacy(chunks, args, os.path.join(root, "legacy"), iteration, training_state)
        out.append({"logits": logits})
    return out
