"""``weightstream example DIR``: a tiny training job to try weightstream on, written to a directory.

It holds what a real job has, at a size that runs on a laptop's CPU in seconds:

- ``hf/``: the model's Hugging Face directory — ``config.json`` (a tiny Qwen3), its random weights
  (``model.safetensors``), a byte-level BPE tokenizer built here (``tokenizer.json``, ``tokenizer_config.json``, a
  chat template) and ``generation_config.json``;
- ``checkpoint/``: the same weights as a Megatron-Core ``torch_dist`` checkpoint (``iter_0000001/``,
  ``latest_checkpointed_iteration.txt``), saved by Megatron-Core itself from a TP-``tp`` model;
- ``train_and_stream.py``: a training script for ``torchrun`` that loads the checkpoint into a Megatron-Core model,
  runs a few optimizer steps and streams the weights into an engine after each one.

Megatron-Core's distributed checkpointing asks CUDA for a device and a synchronisation even on the CPU:
:func:`save_megatron_checkpoint` and :func:`load_megatron_checkpoint` give it a CPU stand-in while they run where
there is no GPU.
"""

from __future__ import annotations

import contextlib
import os
from argparse import Namespace
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from weightstream.errors import WeightstreamError

__all__ = ["ExampleJob", "load_megatron_checkpoint", "save_megatron_checkpoint", "write_example"]

PRESET = "tiny-qwen3"
ITERATION = 1
# What the tokenizer is trained on (a byte-level BPE: every string round-trips, whatever it holds).
_CORPUS = (
    "weightstream streams the weights of a model under training into inference engines, between two rollout "
    "rounds, in the Hugging Face layout they load.",
    "Hello, world! The quick brown fox jumps over the lazy dog. 0123456789",
)
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ExampleError(WeightstreamError):
    """An example job that cannot be written where it was asked for."""


@dataclass(frozen=True, slots=True)
class ExampleJob:
    """Where :func:`write_example` put each part of the job."""

    directory: Path
    tp: int

    @property
    def hf(self) -> Path:
        return self.directory / "hf"

    @property
    def checkpoint(self) -> Path:
        return self.directory / "checkpoint"

    @property
    def script(self) -> Path:
        return self.directory / "train_and_stream.py"

    def next_steps(self) -> str:
        """What was written and the commands to try on it, as the command prints them."""
        d = self.directory
        return "\n".join([
            f"wrote {d}:",
            f"  {self.hf}/          HF directory: config.json, model.safetensors, tokenizer, generation_config.json",
            f"  {self.checkpoint}/  Megatron-Core torch_dist checkpoint (TP {self.tp}) of the same weights",
            f"  {self.script}  training job that streams into an engine after every step",
            "next:",
            f"  weightstream convert {self.checkpoint} --hf {self.hf} --out {d / 'converted'} "
            f"--verify {self.hf}",
            f"  weightstream engine --hf {self.hf} --port 30000 &",
            f"  torchrun --nproc-per-node {self.tp} {self.script} --engine http://127.0.0.1:30000",
        ])


def write_example(directory: str | os.PathLike, *, tp: int = 2, seed: int = 0) -> ExampleJob:
    """Write the example job into ``directory`` (absent or empty): the HF directory, the Megatron checkpoint saved
    by ``tp`` local processes, and the training script. Raises :class:`ExampleError` for a non-empty directory."""
    job = ExampleJob(Path(directory).absolute(), tp)
    if job.directory.exists() and (not job.directory.is_dir() or any(job.directory.iterdir())):
        raise ExampleError(f"{job.directory} is not an empty directory: the example is written into a new one")
    if tp < 1:
        raise ExampleError(f"the example's TP size must be positive, got {tp}")
    job.directory.mkdir(parents=True, exist_ok=True)
    write_hf_directory(job.hf, seed=seed)
    from weightstream.launch import launch

    launch(tp, _save_rank, os.fspath(job.hf), os.fspath(job.checkpoint), tp, backend="gloo")
    job.script.write_text(TRAIN_SCRIPT)
    return job


def write_hf_directory(directory: Path, *, seed: int = 0) -> None:
    """The HF directory of the example model: config, random weights, tokenizer, generation config."""
    from transformers import GenerationConfig

    from weightstream.models.presets import preset_config, save_random_checkpoint

    save_random_checkpoint(preset_config(PRESET), directory, seed=seed)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(directory)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    GenerationConfig(eos_token_id=eos, pad_token_id=eos, max_new_tokens=16, do_sample=False).save_pretrained(directory)


def _tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences, with special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(_SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=_SPECIAL[0], pad_token=_SPECIAL[0])
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def _save_rank(hf_dir: str, root: str, tp: int) -> None:
    """One rank of the job that writes the checkpoint: the HF weights into a TP-``tp`` Megatron-Core model, saved."""
    from weightstream.checks.megatron_models import build_gpt_model, initialize_parallel, load_hf_weights
    from weightstream.common.hf_files import CheckpointReader

    initialize_parallel(tp=tp)
    chunks = build_gpt_model(hf_dir)
    with CheckpointReader(hf_dir) as reader:
        load_hf_weights(chunks, hf_dir, reader)
    save_megatron_checkpoint(chunks, root, ITERATION)


@contextlib.contextmanager
def _cpu_checkpointing() -> Iterator[None]:
    """Where there is no GPU: Megatron-Core's distributed checkpointing synchronises CUDA and puts a flag on the
    current CUDA device; a no-op and the CPU stand in while it runs."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def _megatron_args(chunks: Sequence[nn.Module]) -> Namespace:
    """The part of Megatron-LM's arguments a checkpoint records that readers look at: the parallel layout."""
    from megatron.core import parallel_state as ps

    return Namespace(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                     pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                     virtual_pipeline_model_parallel_size=None if len(chunks) == 1 else len(chunks),
                     expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                     expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
                     ckpt_format="torch_dist")


def _megatron_module(chunk: nn.Module):
    """The Megatron-Core module inside ``chunk`` (DDP / Float16Module wrappers stripped)."""
    from megatron.core.transformer.module import MegatronModule

    from weightstream.sources.megatron import unwrap

    module = unwrap(chunk)
    if not isinstance(module, MegatronModule):
        raise TypeError(f"expected Megatron-Core model chunks, got {type(module).__name__}")
    return module


_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _sharded_state(chunks: Sequence[nn.Module]) -> dict:
    """The model part of the dictionary Megatron-LM saves: ``model``, or ``model0``, ``model1``, ... per VPP chunk
    (of the chunks unwrapped from DDP / Float16Module)."""
    states = [_megatron_module(c).sharded_state_dict(metadata=_METADATA) for c in chunks]
    return {"model": states[0]} if len(states) == 1 else {f"model{i}": s for i, s in enumerate(states)}


def save_megatron_checkpoint(chunks: Sequence[nn.Module], root: str | os.PathLike, iteration: int) -> None:
    """Save Megatron-Core model chunks as Megatron-LM does (``torch_dist``): ``root/iter_{iteration:07d}/`` and
    ``root/latest_checkpointed_iteration.txt``. Call on every rank."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    directory = Path(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"args": _megatron_args(chunks), "checkpoint_version": 3.0, "iteration": iteration,
             **_sharded_state(chunks)}
    with _cpu_checkpointing():
        dist_checkpointing.save(state, os.fspath(directory), content_metadata=_METADATA)
    dist.barrier()
    if dist.get_rank() == 0:
        Path(root, "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


def load_megatron_checkpoint(chunks: Sequence[nn.Module], root: str | os.PathLike) -> int:
    """Load the latest iteration of a ``torch_dist`` checkpoint under ``root`` into Megatron-Core model chunks (any
    TP layout: Megatron-Core reshards); its iteration. Call on every rank."""
    from megatron.core import dist_checkpointing

    iteration = int(Path(root, "latest_checkpointed_iteration.txt").read_text().strip())
    directory = os.fspath(Path(root, f"iter_{iteration:07d}"))
    with _cpu_checkpointing():
        loaded = dist_checkpointing.load(_sharded_state(chunks), directory)
    for i, chunk in enumerate(chunks):
        _megatron_module(chunk).load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"])
    return iteration


TRAIN_SCRIPT = '''"""A tiny training job that streams its weights into an inference engine after every optimizer step.

    weightstream engine --hf hf --port 30000 &               # or SGLang / vLLM / LMDeploy on the same directory
    torchrun --nproc-per-node 2 train_and_stream.py --engine http://127.0.0.1:30000

Each rank loads the Megatron-Core checkpoint (TP = the number of processes), takes --steps optimizer steps on one
sentence, and after each one updates the engine through one weightstream.WeightSync (transport chosen for the
engine: CUDA IPC on the same GPU, broadcast or point-to-point otherwise). --save DIR also writes the trained
weights as an HF checkpoint (with the tokenizer files beside it). WEIGHTSTREAM_API_KEY: the engine's key, if any.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import weightstream as ws
from weightstream.example import load_megatron_checkpoint
from weightstream.checks.megatron_models import build_gpt_model, forward_shims, initialize_parallel

HERE = Path(__file__).resolve().parent
HF = str(HERE / "hf")
CHECKPOINT = HERE / "checkpoint"
TEXT = "The quick brown fox jumps over the lazy dog."


def train_step(model, optimizer, input_ids: torch.Tensor) -> float:
    """One step of next-token prediction on ``input_ids``; the loss."""
    seq = input_ids.shape[1]
    positions = torch.arange(seq).unsqueeze(0)
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    with forward_shims():  # what Megatron-Core needs on a machine without CUDA or Transformer Engine
        losses = model(input_ids[:, :-1], positions[:, :-1], causal[..., :-1, :-1], labels=input_ids[:, 1:])
    loss = losses.float().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="http://127.0.0.1:30000", help="the engine's URL")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps, each followed by an update")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--save", default=None, help="also write the trained weights here as an HF checkpoint")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    initialize_parallel(tp=dist.get_world_size())
    chunks = build_gpt_model(HF)
    iteration = load_megatron_checkpoint(chunks, CHECKPOINT)
    optimizer = torch.optim.SGD(chunks[0].parameters(), lr=args.lr)
    input_ids = torch.tensor([AutoTokenizer.from_pretrained(HF)(TEXT)["input_ids"]])
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"loaded iteration {iteration} of {CHECKPOINT}; {args.steps} step(s) into {args.engine}", flush=True)

    with ws.WeightSync(args.engine, api_key=os.environ.get("WEIGHTSTREAM_API_KEY")) as sync:
        for step in range(args.steps):
            loss = train_step(chunks[0], optimizer, input_ids)
            report = sync.update(chunks, HF, weight_version=str(iteration + step + 1))
            if rank0:
                print(f"step {step + 1}: loss {loss:.4f}; {report.summary()}", flush=True)
    if args.save:
        ws.save_hf_checkpoint(chunks, HF, args.save, overwrite=True)
        if rank0:
            print(f"trained weights written to {args.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''
