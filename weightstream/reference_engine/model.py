"""The reference engine's model: a transformers causal LM split over engine TP ranks.

Each rank holds exactly its shard of the attention and MLP projections (column-parallel
q/k/v/gate/up, row-parallel o/down followed by an all-reduce over the engine's own TP group),
the norms whole, and — as some engines do — the embedding and lm_head whole. ``load_weights``
takes HF checkpoint names with whole tensors (narrowed to this rank's shard here) or with
per-rank shards (checked to be exactly this rank's).

With expert parallelism (``ep`` = the engine's TP size), routed experts held fused are not split: rank r holds
experts ``[r·E/ep, (r+1)·E/ep)`` whole and allocates only those (the fused parameters are ``(E/ep, 2I, H)`` and
``(E/ep, H, I)``); its parameter table names only its own experts, and :attr:`ShardedCausalLM.elsewhere` names the
owner of every other. Before each experts forward the router's choices are made this rank's
(:func:`_local_routing`: another rank's expert becomes transformers' expert-parallel sentinel, which its experts
forward skips), and the experts' output is all-reduced over the group as under TP. Attention, dense MLPs and
shared experts stay TP-split. A whole tensor another rank owns, in a bucket of whole tensors (broadcast, IPC), is
passed over; a name no rank holds is still an error.

A block-FP8 model (its checkpoint's ``quantization_config``) holds its FP8 projections as engines do: the
float8 values ``X.weight`` and their float32 ``X.weight_scale_inv``, loaded as they arrive (from the checkpoint, or
in the same bucket of an update, a colocated trainer writing straight into them), dequantized to the engine's dtype
in each forward (:class:`Float8Linear`; fused routed experts: :class:`Float8Experts`). An FP8 weight whose rank's
part does not fall on the block grid is held dequantized instead, loaded as ``fp8 × scale`` per block.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from weightstream.common.host_memory import return_free_memory
from weightstream.converters.fp8 import dequantize_block_fp8
from weightstream.converters.mapping import Converter
from weightstream.converters.registry import get_converter, known_model_types, model_spec
from weightstream.models.spec import ModelSpec
from weightstream.receiver.backups import BackupPlace, place_for
from weightstream.receiver.schema import ep_problem
from weightstream.streaming.bucket import Shard, TensorMeta
from weightstream.wire.fp8 import FP8, SCALE_SUFFIX, BlockFP8

__all__ = [
    "Weight", "COLUMN", "ROW", "VOCAB", "RowParallelLinear", "Float8Linear", "EXPERT_SCALES", "Float8Experts",
    "LoadReport", "ShardedCausalLM"
]


Weight = tuple[str, Tensor, Shard | None]  # what load_weights takes: a name, a tensor, its placement

# Which projections split which way (checkpoint name suffixes, before ".weight"/".bias").
# Shared experts: Qwen2-MoE's ``mlp.shared_expert``, GLM-4.5's and DeepSeek-V3's ``mlp.shared_experts``.
# Multi-latent attention (DeepSeek-V3): q_b_proj (or q_proj) and kv_b_proj split by heads, q_a_proj and
# kv_a_proj_with_mqa (and their norms) whole.
COLUMN = re.compile(r"\.(self_attn\.([qkv]|q_b|kv_b)_proj|mlp\.(gate|up)_proj|mlp\.shared_experts?\.(gate|up)_proj)$")
ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj|mlp\.shared_experts?\.down_proj)$")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _is_fused_experts(module: nn.Module) -> bool:
    """Routed experts held fused: the module's own parameters ``gate_up_proj`` (3-D) and ``down_proj``."""
    own = dict(module.named_parameters(recurse=False))
    gate_up = own.get("gate_up_proj")
    return gate_up is not None and gate_up.dim() == 3 and "down_proj" in own


def _weight_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The buffers a checkpoint holds (persistent: in the state dict; GLM-4.5's ``e_score_correction_bias``), by
    name; replicated on every rank."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    saved = set(model.state_dict().keys())
    return {name: b for name, b in model.named_buffers() if name in saved and name not in params}


def _everything(name: str) -> bool:
    """Every name (a block-FP8 model whose FP8 weights nothing names)."""
    return True


class RowParallelLinear(nn.Module):
    """A row-parallel projection: this rank's input columns, partial sums all-reduced over the group."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.linear = linear
        self.group = group

    @property
    def weight(self) -> Tensor:
        return self.linear.weight

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(out, group=self.group)
        return out


class Float8Linear(nn.Module):
    """A projection held in block FP8: float8 ``weight`` and float32 ``weight_scale_inv`` (one per block, this
    rank's), dequantized to the input's dtype in each forward."""

    def __init__(self, linear: nn.Linear, fp8: BlockFP8):
        super().__init__()
        self.block = fp8.block
        device = linear.weight.device
        self.weight = nn.Parameter(torch.zeros(linear.weight.shape, dtype=FP8, device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.ones(fp8.scale_shape(tuple(linear.weight.shape)),
                                                        dtype=torch.float32, device=device), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        weight = dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block, dtype=x.dtype)
        return F.linear(x, weight, self.bias)


EXPERT_SCALES = ("experts.gate_scale_inv", "experts.up_scale_inv", "experts.down_scale_inv")


def _dequantize_experts(values: Tensor, scales: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """:func:`dequantize_block_fp8` of every expert at once: ``values`` (experts, rows, cols), ``scales``
    (experts, row blocks, column blocks)."""
    _, rows, cols = values.shape
    expanded = scales.repeat_interleave(block[0], dim=1)[:, :rows].repeat_interleave(block[1], dim=2)[:, :, :cols]
    return (values.float() * expanded).to(dtype)


class Float8Experts:
    """Fused routed experts (transformers' ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)) held in block FP8:
    the two parameters in float8, and ``gate_scale_inv``, ``up_scale_inv``, ``down_scale_inv`` per expert. For each
    forward the module's parameters are the dequantized weights (in the activations' dtype), and the float8 ones
    again after it."""

    def __init__(self, fp8: BlockFP8):
        self.fp8 = fp8
        self.held: tuple[nn.Parameter, nn.Parameter] | None = None

    def attach(self, module: nn.Module, gate_up: Tensor, down: Tensor) -> None:
        """Hold ``module``'s experts in FP8 in place of ``gate_up`` and ``down``, whose memory goes first: a layer's
        unquantized experts and its FP8 ones are never held at once (a Qwen3-30B-A3B engine's 58 GB of bf16 experts
        and their 29 GB in FP8 would not fit an 80 GB card together)."""
        experts, two_inter, hidden = gate_up.shape
        inter, device = two_inter // 2, gate_up.device
        shapes = tuple(gate_up.shape), tuple(down.shape)
        for unquantized in (gate_up, down):  # (a storage the tensor shares with others is left to them)
            if unquantized.untyped_storage().nbytes() == unquantized.numel() * unquantized.element_size():
                unquantized.untyped_storage().resize_(0)

        def frozen(shape: tuple[int, ...], dtype: torch.dtype, fill: float) -> nn.Parameter:
            return nn.Parameter(torch.full(shape, fill, dtype=dtype, device=device), requires_grad=False)

        module.gate_up_proj = frozen(shapes[0], FP8, 0.0)
        module.down_proj = frozen(shapes[1], FP8, 0.0)
        part, down_part = self.fp8.scale_shape((inter, hidden)), self.fp8.scale_shape((hidden, inter))
        module.gate_scale_inv = frozen((experts, *part), torch.float32, 1.0)
        module.up_scale_inv = frozen((experts, *part), torch.float32, 1.0)
        module.down_scale_inv = frozen((experts, *down_part), torch.float32, 1.0)
        module.register_forward_pre_hook(self._dequantize)
        module.register_forward_hook(self._restore)

    def _dequantize(self, module: nn.Module, args: tuple) -> None:
        own = dict(module.named_parameters(recurse=False))
        gate_up, down = own["gate_up_proj"], own["down_proj"]
        inter, dtype = down.shape[2], args[0].dtype
        gate = _dequantize_experts(gate_up[:, :inter], own["gate_scale_inv"], self.fp8.block, dtype)
        up = _dequantize_experts(gate_up[:, inter:], own["up_scale_inv"], self.fp8.block, dtype)
        self.held = (gate_up, down)
        module._parameters["gate_up_proj"] = nn.Parameter(torch.cat([gate, up], dim=1), requires_grad=False)
        module._parameters["down_proj"] = nn.Parameter(
            _dequantize_experts(down, own["down_scale_inv"], self.fp8.block, dtype), requires_grad=False)

    def _restore(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.held is not None:
            module._parameters["gate_up_proj"], module._parameters["down_proj"] = self.held
            self.held = None


def _split(n: int, size: int, what: str, kind: str = "TP") -> int:
    if n % size:
        raise ValueError(f"{what}: {n} is not divisible by engine {kind} {size}")
    return n // size


def _local_routing(first: int, local: int, module: nn.Module, args: tuple) -> tuple:
    """A forward pre-hook of fused experts held under expert parallelism (this rank's ``local`` experts, the first
    of them global expert ``first``): the router's expert indices as this rank's, any other rank's expert as
    ``local`` (transformers' expert-parallel sentinel, one past the experts held: skipped by its experts forward)
    with a routing weight of 0."""
    if len(args) != 3:
        raise TypeError(f"{type(module).__name__}: expert parallelism takes the experts' forward as (hidden states, "
                        f"expert indices, routing weights), positionally; got {len(args)} positional arguments")
    hidden, index, weights = args
    mine = (index >= first) & (index < first + local)
    return hidden, torch.where(mine, index - first, local), weights.masked_fill(~mine, 0)


@dataclass
class LoadReport:
    loaded: Sequence[str]
    problems: list[str]


class ShardedCausalLM:
    """A transformers model whose projections are split over ``size`` ranks (this is ``rank``); ``ep``: 1 (routed
    experts split like the dense MLP), or ``size`` (expert parallelism: each rank holds its experts whole)."""

    def __init__(self, config, rank: int, size: int, group, device: torch.device, dtype: torch.dtype = torch.float32,
                 ep: int = 1):
        from transformers import AutoModelForCausalLM

        if config.num_key_value_heads % size or config.num_attention_heads % size:
            raise ValueError(
                f"engine TP {size} must divide the attention heads ({config.num_attention_heads}) "
                f"and KV heads ({config.num_key_value_heads})"
            )
        if (problem := ep_problem(ep, size)) is not None:
            raise ValueError(problem)
        self.config, self.rank, self.size, self.group, self.ep = config, rank, size, group, ep
        # The family's declaration of how transformers holds the model, where it holds it otherwise than the
        # checkpoint names it (None: the names are the checkpoint's).
        self.memory: Converter | None = None
        self.spec: ModelSpec | None = None
        if config.model_type in known_model_types() and get_converter(config.model_type).memory:
            self.memory, self.spec = get_converter(config.model_type).in_memory(), model_spec(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self._shard_modules(model)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gives each module its own storage: tie again what the config ties
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
            for b in _weight_buffers(model).values():  # GLM-4.5's score-correction bias: a weight held in a buffer
                b.zero_()
        # Rotary embeddings compute their buffers at construction: build them again, for real.
        for name, module in list(model.named_modules()):
            if type(module).__name__.endswith("RotaryEmbedding"):
                parent_name, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent_name), attr, type(module)(module.config).to(device))
        model.eval()
        self.model = model
        self.params, self.elsewhere = self._tables()
        self.backup: dict[str, Tensor] | None = None  # during a session: what each touched tensor held before
        self.device = device
        self.released_bytes = 0
        self.released: list[tuple[Any, int]] = []  # the storages release_weights emptied, with their sizes
        self.stale: set[str] = set()  # released (or half-updated) weights no update has loaded since
        self.stale_why = ""
        self.rollback = True  # back up what a session overwrites (else an aborted session leaves weights stale)
        # where the open (or last) session keeps its backups, and how many bytes they took
        self.backup_at = BackupPlace("none", "no session yet")
        self.backup_bytes = 0
        # the names each load of the open session covered (joined only where a commit or abort needs them)
        self._loaded_in_session: list[Collection[str]] = []
        # vocabulary row pieces (per-rank embedding / lm_head) received, for exchange_vocab_pieces
        self.pending_vocab: list[tuple[str, int, Tensor]] = []
        self.fp8: BlockFP8 | None = None  # the model's block-FP8 layout (None: an unquantized model)
        self.fp8_weights: frozenset[str] | None = None  # the weights it holds in FP8 (None: by the declaration)
        self.fp8_declared: Callable[[str], bool] = _everything  # the family's FP8 weights (Converter.quantizes)
        self.stored_fp8: set[str] = set()  # FP8 weights held as float8 values and scales (Float8Linear)

    def quantized(self, fp8: BlockFP8 | None, names: Iterable[str],
                  declared: Callable[[str], bool] = _everything) -> None:
        """The model is block FP8 (``fp8``; None: it is not): the weights among ``names`` (a checkpoint's)
        that have a scale beside them are held in FP8, and updates must send them so; with no checkpoint
        weights, those ``declared`` (the family's FP8 declaration)."""
        self.fp8, self.fp8_declared = fp8, declared
        held = {n[: -len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)}
        self.fp8_weights = frozenset(held) if held or fp8 is None else None
        if fp8 is not None:
            self._hold_float8(fp8)

    def _hold_float8(self, fp8: BlockFP8) -> None:
        """Each projection held in FP8 whose rank's part falls on the block grid becomes a :class:`Float8Linear`
        (its float8 values and scales are then loaded, and written into, as they are)."""
        for name, module in list(self.model.named_modules()):
            if _is_fused_experts(module):
                self._hold_float8_experts(name, module, fp8)
                continue
            if not isinstance(module, nn.Linear):
                continue
            weight = self._checkpoint_names(f"{name}.weight".replace(".linear.", "."))[0]
            entry = self.params.get(weight)
            if entry is None or not self._held_fp8(weight) or not self._on_blocks(entry[0], entry[1], fp8):
                continue
            parent_name, _, attr = name.rpartition(".")
            setattr(self.model.get_submodule(parent_name), attr, Float8Linear(module, fp8))
            self.stored_fp8.add(weight)
        self.params, self.elsewhere = self._tables()
        if self.device.type == "cuda":  # the unquantized weights just dropped: give their memory back to the device
            torch.cuda.empty_cache()

    def _hold_float8_experts(self, name: str, module: nn.Module, fp8: BlockFP8) -> None:
        """Fused routed experts held in FP8 whose rank's part falls on the block grid: ``gate_up_proj`` and
        ``down_proj`` in float8, with the scales of each expert's gate, up and down (:class:`Float8Experts`)."""
        gate_up, down = module.get_parameter("gate_up_proj"), module.get_parameter("down_proj")
        local, two_inter, hidden = gate_up.shape
        inter = two_inter // 2
        names = self._expert_names(name, local * self.ep)
        if not all(self._held_fp8(n) for n in names[0] + names[1]):
            return
        # Split over the ranks (EP 1), each rank's part of an expert must be whole blocks; under EP it is the expert.
        if self.ep == 1 and self.size > 1 and (inter % fp8.block[0] or inter % fp8.block[1]):
            return
        Float8Experts(fp8).attach(module, gate_up, down)
        mine = self._own_experts(local)
        self.stored_fp8.update(n for x in mine for n in (names[0][2 * x], names[0][2 * x + 1], names[1][x]))

    def _on_blocks(self, param: Tensor, dim: int | None, fp8: BlockFP8) -> bool:
        """Whether this rank's part of a weight (``param``, split on ``dim``) is whole blocks of the whole weight."""
        return dim is None or self.size == 1 or param.shape[dim] % fp8.block[dim] == 0

    def mark_never_loaded(self, loaded: set[str]) -> None:
        """After the weights found at start: every tensor they did not hold is stale (the engine refuses to
        serve until a complete update loads it), never served as the zeros it was created with."""
        self.stale = set(self.params) - loaded
        self.stale_why = "were never loaded (the engine started without them)"

    # -- sessions: an update is committed whole or rolled back whole --------------------------------

    def begin_session(self) -> BackupPlace:
        """Open a session; where its backups go (:mod:`~weightstream.receiver.backups`), decided now."""
        self.backup_at = (place_for(self._weight_bytes(), self.device) if self.rollback
                          else BackupPlace("none", "rollback is off for this engine"))
        self.backup = {} if self.backup_at.where != "none" else None
        self.backup_bytes = 0
        self.pending_vocab = []
        self._loaded_in_session = []
        return self.backup_at

    def _weight_bytes(self) -> int:
        """What a full update could overwrite on this rank, at most: the bytes of the model's storages (a few per layer
        to look at, where the loadable tensors are thousands of views of them)."""
        return sum(st.nbytes() for st in self._storages())

    def _session_loaded(self) -> set[str]:
        return set().union(*self._loaded_in_session)

    def prepare_session(self) -> None:
        """What could still fail at a commit, done now, undoable: every stale tensor must have been loaded, and
        the vocabulary pieces are exchanged (into parameters the backup already covers). After it, the commit
        only drops the backup; an abort still puts the last committed weights back."""
        missing = self.stale - self._session_loaded() if self.stale else set()
        if missing:
            raise RuntimeError(f"{len(missing)} tensors {self.stale_why} and this update did not load them "
                               f"(e.g. {sorted(missing)[:3]}); the update is not committed")
        self.exchange_vocab_pieces()

    def commit_session(self) -> None:
        """Prepare (:meth:`prepare_session`, once more where it ran: nothing is pending then), then drop the
        backup."""
        self.prepare_session()
        self.backup = None
        self.stale = set()

    @torch.no_grad()
    def rollback_session(self) -> int:
        """Put back what the session overwrote; returns how many tensors were restored. Without a backup
        (``rollback`` off) what the session loaded is stale: the engine serves again once an update has
        loaded it."""
        backup, self.backup = self.backup or {}, None
        self.pending_vocab = []
        if self.backup_at.where == "none" and self._loaded_in_session:
            self.stale |= self._session_loaded()
            why = "this engine keeps no backup" if not self.rollback else f"its session kept none: {self.backup_at.why}"
            self.stale_why = f"were half-updated by an aborted update ({why})"
        for name, old in backup.items():
            param = self.params[name][0]
            param.copy_(old.view(param.shape))
        return len(backup)

    # -- memory: released between rollouts, re-created before the next update -----------------------

    def _storages(self) -> list:
        seen, out = set(), []
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            st = t.untyped_storage()
            if st.data_ptr() not in seen and st.nbytes():
                seen.add(st.data_ptr())
                out.append(st)
        return out

    def release_weights(self) -> int:
        """Free the weights' memory (contents are discarded, as SGLang does without a CPU backup): every
        weight is then stale until an update loads it. Buffers the model computes itself (rotary
        tables) are kept. Returns the bytes freed."""
        if self.released_bytes:
            return 0
        buffers = {b.untyped_storage().data_ptr() for b in self.model.buffers()}
        freed = 0
        self.released = []
        for st in self._storages():
            if st.data_ptr() in buffers:
                continue
            self.released.append((st, st.nbytes()))
            freed += st.nbytes()
            if st.device.type == "cpu" and st.is_shared():
                # Shared memory (a colocated trainer was given it to write into) cannot be resized in place:
                # its memory is swapped for none, and unmapped as the swapped-out storage is dropped.
                st._swap_data_ptr_(torch.UntypedStorage(0))
            else:
                st.resize_(0)
        self.released_bytes = freed
        self.stale = set(self.params)
        self.stale_why = "were released"
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # storages a trainer had mapped (and has let go of) are freed now too
            torch.cuda.empty_cache()
        else:  # the freed weights go back to the system, wherever the C library had put them
            return_free_memory()
        return freed

    def resume_weights(self) -> int:
        """Re-create the weights' memory, zeroed; they stay stale until an update loads them."""
        for st, nbytes in self.released:
            st.resize_(nbytes)
            st.fill_(0)
        restored, self.released, self.released_bytes = self.released_bytes, [], 0
        return restored

    def _keep(self, tensors: Sequence[tuple[str, Tensor]]) -> None:
        """Back up, in one batched copy, what this session is about to overwrite for the first time:
        ``(name, the parameter or a view of all of it)``."""
        if self.backup is None:
            return
        first = [(n, t) for n, t in tensors if n not in self.backup]
        if not first:
            return
        by_dtype: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
        for n, t in first:
            by_dtype.setdefault(t.dtype, []).append((n, t))
        host = self.backup_at.where == "host"
        for dtype, group in by_dtype.items():  # one allocation per dtype, not one per tensor
            flat = torch.empty(sum(t.numel() for _, t in group), dtype=dtype,
                               device="cpu" if host else group[0][1].device, pin_memory=host)
            self.backup_bytes += flat.numel() * flat.element_size()
            copies = flat.split_with_sizes([t.numel() for _, t in group])
            torch._foreach_copy_(list(copies), [t if t.dim() == 1 else t.reshape(-1) for _, t in group])
            self.backup.update((n, c) for (n, _), c in zip(group, copies, strict=True))  # flat: shaped back on rollback

    def _shard_modules(self, model: nn.Module) -> None:
        for name, module in list(model.named_modules()):
            if _is_fused_experts(module):
                self._shard_experts(module)
                continue
            if not isinstance(module, nn.Linear):
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            if COLUMN.search("." + name):
                out = _split(module.out_features, self.size, name)
                setattr(parent, attr, nn.Linear(module.in_features, out, bias=module.bias is not None,
                                                dtype=module.weight.dtype, device=module.weight.device))
            elif ROW.search("." + name):
                inp = _split(module.in_features, self.size, name)
                linear = nn.Linear(inp, module.out_features, bias=module.bias is not None,
                                   dtype=module.weight.dtype, device=module.weight.device)
                setattr(parent, attr, RowParallelLinear(linear, self.group))

    def _shard_experts(self, experts: nn.Module) -> None:
        """Routed experts held fused (transformers 5: ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)):
        keep this rank's I-slice of every expert (EP 1), or this rank's experts whole (:meth:`_hold_own_experts`);
        the partial sums are all-reduced after the block."""
        gate_up, down = experts.get_parameter("gate_up_proj"), experts.get_parameter("down_proj")
        e, two_i, h = gate_up.shape
        dtype = gate_up.dtype
        if self.ep > 1:
            self._hold_own_experts(experts, _split(e, self.ep, "routed experts", "EP"))
        else:
            inter = _split(two_i // 2, self.size, "expert intermediate size")
            experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h, dtype=dtype, device=gate_up.device))
            experts.down_proj = nn.Parameter(torch.empty(e, h, inter, dtype=dtype, device=down.device))
        group = self.group

        def reduce_output(module, args, output):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(output, group=group)
            return output

        experts.register_forward_hook(reduce_output)

    def _hold_own_experts(self, experts: nn.Module, local: int) -> None:
        """Expert parallelism: this rank's ``local`` experts, whole, are all the fused parameters hold (the others
        are not allocated); the router's choices are made this rank's before each forward (:func:`_local_routing`)."""
        gate_up, down = experts.get_parameter("gate_up_proj"), experts.get_parameter("down_proj")
        experts.gate_up_proj = nn.Parameter(torch.empty(local, *gate_up.shape[1:], dtype=gate_up.dtype,
                                                        device=gate_up.device))
        experts.down_proj = nn.Parameter(torch.empty(local, *down.shape[1:], dtype=down.dtype, device=down.device))
        # (torch types a module's attributes as tensors and modules: these two are transformers' plain ones)
        experts.num_experts = local  # type: ignore[assignment]
        # transformers' own flag for experts held under EP: its batched and grouped forwards then mask the sentinel
        experts._is_expert_parallel = True  # type: ignore[assignment]
        experts.register_forward_pre_hook(partial(_local_routing, self.rank * local, local))

    def _own_experts(self, local: int) -> range:
        """The global indices of the experts this rank holds, of fused experts holding ``local``."""
        first = self.rank * local if self.ep > 1 else 0
        return range(first, first + local)

    def _expert_table(self, name: str, module: nn.Module) -> tuple[dict[str, tuple[Tensor, int | None]],
                                                                     dict[str, int]]:
        """Fused experts ``name``: the checkpoint names of this rank's experts -> (a view of the fused parameter,
        split dim or None), and those of the experts other ranks hold -> their owner (under EP; else none)."""
        own = dict(module.named_parameters(recurse=False))
        fused_gate_up, fused_down = own["gate_up_proj"].data, own["down_proj"].data
        local, inter = fused_gate_up.shape[0], fused_down.shape[2]
        gate_up, down = self._expert_names(name, local * self.ep)
        fp8 = "gate_scale_inv" in own  # held in block FP8 (Float8Experts)
        rows, cols = (0, 1) if self.ep == 1 else (None, None)
        table: dict[str, tuple[Tensor, int | None]] = {}
        elsewhere: dict[str, int] = {}
        mine = self._own_experts(local)
        for x in range(local * self.ep):
            names = (gate_up[2 * x], gate_up[2 * x + 1], down[x])
            if x not in mine:
                scales = tuple(n + SCALE_SUFFIX for n in names) if fp8 else ()
                elsewhere.update(dict.fromkeys(names + scales, x // local))
                continue
            j = x - mine.start
            table[names[0]] = (fused_gate_up[j, :inter], rows)
            table[names[1]] = (fused_gate_up[j, inter:], rows)
            table[names[2]] = (fused_down[j], cols)
            if fp8:
                table[names[0] + SCALE_SUFFIX] = (own["gate_scale_inv"].data[j], rows)
                table[names[1] + SCALE_SUFFIX] = (own["up_scale_inv"].data[j], rows)
                table[names[2] + SCALE_SUFFIX] = (own["down_scale_inv"].data[j], cols)
        return table, elsewhere

    def _tables(self) -> tuple[dict[str, tuple[Tensor, int | None]], dict[str, int]]:
        """checkpoint name -> (parameter or a view of one, split dim or None); and, under expert parallelism, the
        checkpoint names of the experts other ranks hold -> their owner."""
        table: dict[str, tuple[Tensor, int | None]] = {}
        elsewhere: dict[str, int] = {}
        for name, module in self.model.named_modules():
            if _is_fused_experts(module):
                mine, theirs = self._expert_table(name, module)
                table.update(mine)
                elsewhere.update(theirs)
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if name.endswith(("experts.gate_up_proj", "experts.down_proj") + EXPERT_SCALES):
                continue
            name = name.replace(".linear.", ".")
            module_path = name.rsplit(".", 1)[0]
            row = ROW.search("." + module_path) and name.endswith((".weight", ".weight" + SCALE_SUFFIX))
            dim = 0 if COLUMN.search("." + module_path) else 1 if row else None
            table[self._checkpoint_names(name)[0]] = (p, dim)
        for name, b in _weight_buffers(self.model).items():
            table[name] = (b, None)
        # A tied weight (lm_head's, where the config ties it to the embedding) loads under its first name only.
        first = {name for name, _ in self.model.named_parameters()}
        for name, _ in self.model.named_parameters(remove_duplicate=False):
            if name not in first:
                table.pop(self._checkpoint_names(name.replace(".linear.", "."))[0], None)
        return table, elsewhere

    def owners(self) -> dict[str, int]:
        """The tensors one rank holds alone (experts under expert parallelism: every rank's, this one's included),
        checkpoint name -> that rank; none without expert parallelism."""
        out: dict[str, int] = {}
        for name, module in self.model.named_modules():
            if self.ep > 1 and _is_fused_experts(module):
                mine, theirs = self._expert_table(name, module)
                out.update(dict.fromkeys(mine, self.rank))
                out.update(theirs)
        return out

    def _checkpoint_names(self, name: str) -> tuple[str, ...]:
        """The checkpoint names of the tensor transformers holds as ``name``, as the family declares them
        (``Converter.memory``: Mixtral's ``mlp.gate`` is ``block_sparse_moe.gate``; fused experts are one name per
        expert and part); the name itself where the family declares nothing for it."""
        if self.memory is None or self.spec is None:
            return (name,)
        resolved = self.memory.resolve(name, self.spec)
        return resolved.hf_names if resolved is not None else (name,)

    def _expert_names(self, name: str, experts: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The checkpoint names of fused experts ``name``: (gate, up) per expert, down per expert."""
        gate_up, down = self._checkpoint_names(f"{name}.gate_up_proj"), self._checkpoint_names(f"{name}.down_proj")
        if len(gate_up) != 2 * experts or len(down) != experts:  # a model no family declares: transformers' names
            gate_up = tuple(f"{name}.{x}.{part}_proj.weight" for x in range(experts) for part in ("gate", "up"))
            down = tuple(f"{name}.{x}.down_proj.weight" for x in range(experts))
        return gate_up, down

    def expected_names(self) -> list[str]:
        return sorted(self.params)

    def whole_targets(self, metas) -> list[Tensor] | None:
        """For a bucket of whole tensors that this rank holds whole (engine TP 1, or tensors not split):
        each tensor's parameter as a flat view, in order; None where any tensor needs more than a copy
        (a shard, a narrowed or vocabulary tensor, an unknown name, another shape or dtype), which then
        goes through :meth:`load_weights`."""
        out = []
        for m in metas:
            entry = self.params.get(m.name)
            if (entry is None or m.shard is not None or (m.name in VOCAB and self.size > 1)
                    or (self._held_fp8(m.name) and m.name not in self.stored_fp8)):
                return None
            param, dim = entry
            if (dim is not None and self.size > 1) or tuple(param.shape) != tuple(m.shape) or param.dtype != m.dtype:
                return None
            if not param.is_contiguous():
                return None
            out.append(param.view(-1))
        return out

    def piece_targets(self, metas: Sequence[TensorMeta]) -> list[Tensor] | None:
        """For a resharded bucket whose pieces (checked to tile this rank's parts: ``piece_problems``) each load by a
        plain copy: the view of this rank's parameter each piece fills (all of it, or the rows or columns it is
        placed at), in order. None where any piece needs more (another dtype, a vocabulary tensor, a tensor held in
        block FP8 or its scale, a piece placed on another dim than the rank's part), which then goes through
        :func:`~weightstream.receiver.pieces.assemble` and :meth:`load_weights`."""
        out = []
        for m in metas:
            entry = self.params.get(m.name)
            if (entry is None or m.name in VOCAB or self._held_fp8(m.name) or m.name.endswith(SCALE_SUFFIX)
                    or entry[0].dtype != m.dtype):
                return None
            param, dim = entry
            split = dim is not None and self.size > 1
            if m.shard is None:
                if split or tuple(param.shape) != tuple(m.shape):
                    return None
                out.append(param)
                continue
            on = m.shard.dim
            if (split and on != dim) or on >= param.dim():
                return None
            start = m.shard.start - (self.rank * param.shape[on] if split else 0)
            if start < 0 or start + m.shard.length > param.shape[on]:
                return None
            view = param.narrow(on, start, m.shard.length)
            if tuple(view.shape) != tuple(m.shape):
                return None
            out.append(view)
        return out

    @torch.no_grad()
    def load_flat(self, names: Sequence[str], targets: Sequence[list[Tensor]],
                  copies: Sequence[Callable[[], Any]]) -> LoadReport:
        """Run ``copies`` (batched copies into ``targets``, flat views of parameters from
        :meth:`whole_targets`, per dtype; ``names`` of all of them in order), keeping the session's backups
        first, with one batched copy per dtype."""
        if self.released_bytes:
            return LoadReport([], [f"{n}: the weights are released; resume them before loading" for n in names])
        if self.backup is not None:
            self._keep(list(zip(names, (t for group in targets for t in group), strict=True)))
        for copy in copies:
            copy()
        self._loaded_in_session.append(names)
        return LoadReport(names, [])

    @torch.no_grad()
    def begin_writes(self, names: Sequence[str], targets: Sequence[Tensor]) -> None:
        """A colocated trainer is about to write ``names`` straight into ``targets`` (flat views of their
        parameters, from :meth:`whole_targets`): their backups are kept first, and they count as loaded by
        this session (an abort puts them back, or, without backups, marks them stale)."""
        if self.released_bytes:
            raise RuntimeError("the weights are released; resume them before an update writes into them")
        if self.backup is not None:  # (no per-tensor work per update without backups)
            self._keep(list(zip(names, targets, strict=True)))
        self._loaded_in_session.append(names)

    def _held_fp8(self, name: str) -> bool:
        """Whether the model holds ``name`` in block FP8 (an update must send it as float8 with its scales)."""
        if self.fp8 is None:
            return False
        return name in self.fp8_weights if self.fp8_weights is not None else self.fp8_declared(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[Weight]) -> LoadReport:
        """Copy tensors in. Whole tensors are narrowed to this rank's part; shards must be this rank's.
        Vocabulary row pieces (per-rank embedding/lm_head) are placed by row; the caller completes them
        with :meth:`exchange_vocab_pieces`. Whole tensors another rank holds alone are passed over
        (:meth:`_others_passed_over`). Block-FP8 pairs are dequantized first (:meth:`_dequantized`); where any is
        wrong, nothing of ``weights`` is loaded."""
        weights, problems = self._others_passed_over(list(weights))
        weights, fp8_problems = self._dequantized(weights)
        if fp8_problems:
            return LoadReport([], problems + fp8_problems)
        loaded: list[str] = []
        # Checked one by one, copied together: one _foreach_copy_ for the backups of the tensors this
        # session touches first, one for the new values.
        names: list[str] = []
        dst: list[Tensor] = []
        src: list[Tensor] = []
        for name, tensor, shard in weights:
            entry = self.params.get(name)
            if entry is None:
                problems.append(f"{name}: the model has no such tensor")
                continue
            param, dim = entry
            if self.released_bytes:
                problems.append(f"{name}: the weights are released; resume them before loading")
                continue
            try:
                if name in VOCAB and shard is not None:
                    self._load_vocab_piece(name, tensor, shard, param)
                else:
                    src.append(self._fitted(tensor, shard, param, dim))
                    names.append(name)
                    dst.append(param)
                loaded.append(name)
            except (ValueError, RuntimeError) as exc:
                problems.append(f"{name}: {exc}")
        self._loaded_in_session.append(loaded)
        self._keep(list(zip(names, dst, strict=True)))
        if dst:
            torch._foreach_copy_(dst, src)
        return LoadReport(loaded, problems)

    def _others_passed_over(self, weights: list[Weight]) -> tuple[list[Weight], list[str]]:
        """``weights`` less the whole tensors another rank holds alone (under expert parallelism a bucket of whole
        tensors carries every rank's experts: each rank takes its own), and a problem for each shard of one."""
        if not self.elsewhere:
            return weights, []
        kept: list[Weight] = []
        problems: list[str] = []
        for name, tensor, shard in weights:
            owner = self.elsewhere.get(name)
            if owner is None:
                kept.append((name, tensor, shard))
            elif shard is not None:
                problems.append(f"{name}: a shard {shard} of a tensor engine rank {owner} holds alone, whole")
        return kept, problems

    def _dequantized(self, weights: list[Weight]) -> tuple[list[Weight], list[str]]:
        """``weights`` with each block-FP8 pair (``X.weight`` in float8, ``X.weight_scale_inv``) as ``X.weight``
        dequantized to the model's dtype; or, where anything of FP8 is wrong, nothing and every problem."""
        scales = {n[: -len(SCALE_SUFFIX)]: (t, s) for n, t, s in weights if n.endswith(SCALE_SUFFIX)}
        if self.fp8 is None:
            fp8 = sorted({n for n, t, _ in weights if t.dtype == FP8} | {n + SCALE_SUFFIX for n in scales})
            if fp8:
                return [], [f"block-FP8 tensors for a model this engine holds unquantized (its checkpoint has no "
                            f"block-FP8 quantization_config): {', '.join(fp8[:4])}" + (" ..." if len(fp8) > 4 else "")]
            return weights, []
        out: list[Weight] = []
        problems: list[str] = []
        values = {n for n, t, _ in weights if t.dtype == FP8}
        for name, tensor, shard in weights:
            if name.endswith(SCALE_SUFFIX):
                if name[: -len(SCALE_SUFFIX)] not in values:
                    problems.append(f"{name}: a scale without its float8 weight {name[: -len(SCALE_SUFFIX)]} "
                                    "in the same bucket")
                elif name[: -len(SCALE_SUFFIX)] in self.stored_fp8:
                    out.append((name, tensor, shard))  # checked with its weight (_fp8_pair)
                continue
            try:
                out.append((name, self._fp8_pair(name, tensor, shard, scales.get(name)), shard))
            except ValueError as exc:
                problems.append(f"{name}: {exc}")
        return (out, []) if not problems else ([], problems)

    def _fp8_pair(self, name: str, tensor: Tensor, shard: Shard | None,
                  scale: tuple[Tensor, Shard | None] | None) -> Tensor:
        """What a tensor of a block-FP8 model's bucket loads as: a float8 weight (with its ``scale``)
        dequantized, any other as it is; ValueError where it does not fit the model's layout."""
        if tensor.dtype != FP8:
            if scale is not None:
                raise ValueError(f"a scale came with it, but it is {tensor.dtype}, not float8_e4m3fn")
            if self._held_fp8(name):
                raise ValueError(f"arrived as {tensor.dtype}, but this engine holds it in block FP8: it takes the "
                                 f"float8 values with their {name + SCALE_SUFFIX} in the same bucket")
            return tensor
        assert self.fp8 is not None
        if scale is None:
            raise ValueError(f"float8 without its scale {name + SCALE_SUFFIX} in the same bucket")
        if not self._held_fp8(name):
            raise ValueError("arrived in block FP8, but this engine holds it unquantized")
        values, (scales, scale_shard) = tensor, scale
        want = self.fp8.scale_shape(tuple(values.shape))
        if tuple(scales.shape) != want or scales.dtype != torch.float32:
            raise ValueError(f"its scale is {scales.dtype} of shape {tuple(scales.shape)}; a weight of shape "
                             f"{tuple(values.shape)} in {self.fp8.block} blocks takes float32 of shape {want}")
        if shard is not None and shard.start % self.fp8.block[shard.dim]:
            raise ValueError(f"its shard {shard} does not start on a {self.fp8.block[shard.dim]}-wide block")
        if scale_shard != self._scale_shard(shard):
            raise ValueError(f"its scale is placed at {scale_shard}, its weight at {shard}: the weight's blocks "
                             f"take {self._scale_shard(shard)}")
        if name in self.stored_fp8:
            return values  # held as float8 values and scales: loaded as they are
        entry = self.params.get(name)
        dtype = entry[0].dtype if entry is not None else torch.float32
        return dequantize_block_fp8(values, scales.to(values.device), self.fp8.block, dtype=dtype)

    def _scale_shard(self, shard: Shard | None) -> Shard | None:
        """Where the scales of a weight's ``shard`` (starting on a block) sit in its whole scales, in blocks;
        None for a whole weight."""
        if shard is None or self.fp8 is None:
            return None
        block = self.fp8.block[shard.dim]
        return Shard(shard.dim, shard.start // block, math.ceil(shard.length / block), math.ceil(shard.full / block))

    def _load_vocab_piece(self, name: str, tensor: Tensor, shard: Shard, param: Tensor) -> None:
        """Rows of the embedding or lm_head, placed at once (their backup kept first) and kept for
        :meth:`exchange_vocab_pieces`."""
        if shard.dim != 0 or shard.full != param.shape[0] or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"vocabulary piece {shard} does not fit {tuple(param.shape)}")
        self._keep([(name, param)])
        param.narrow(0, shard.start, shard.length).copy_(tensor)
        self.pending_vocab.append((name, shard.start, tensor.detach().to(param.device, copy=True)))

    def _fitted(self, tensor: Tensor, shard: Shard | None, param: Tensor, dim: int | None) -> Tensor:
        """``tensor`` as what is copied into ``param`` (split on ``dim``, or held whole where None): this rank's
        part of a whole tensor, or a shard checked to be this rank's; in the parameter's dtype and device."""
        if dim is None:
            if shard is not None:
                raise ValueError(f"got a shard {shard} of a tensor the engine holds whole")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"shape {tuple(tensor.shape)} != engine's {tuple(param.shape)}")
        else:
            n = param.shape[dim]
            if shard is None:
                full = list(param.shape)
                full[dim] *= self.size
                if list(tensor.shape) != full:
                    raise ValueError(f"shape {tuple(tensor.shape)} != whole tensor {tuple(full)}")
                tensor = tensor.narrow(dim, self.rank * n, n)
            elif (shard.dim, shard.start, shard.length, shard.full) != (dim, self.rank * n, n, n * self.size):
                raise ValueError(
                    f"shard {shard} is not engine rank {self.rank}'s "
                    f"(dim {dim}, rows {self.rank * n}..{(self.rank + 1) * n})"
                )
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"shape {tuple(tensor.shape)} != engine's shard {tuple(param.shape)}")
        if tensor.dtype != param.dtype or tensor.device != param.device:
            tensor = tensor.to(device=param.device, dtype=param.dtype)
        return tensor

    @torch.no_grad()
    def exchange_vocab_pieces(self) -> None:
        """Every rank sends the vocabulary rows it received to the others (engine-internal), so the
        whole embedding / lm_head is complete on every rank."""
        pieces, self.pending_vocab = self.pending_vocab, []
        if self.size == 1:
            return
        listing = [(name, start, tuple(t.shape), str(t.dtype)) for name, start, t in pieces]
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, listing, group=self.group)
        mine = {(name, start): t for name, start, t in pieces}
        for src, entries in enumerate(everyone):
            for name, start, shape, _ in entries:
                param = self.params[name][0]
                if src == self.rank:
                    buf = mine[(name, start)].contiguous()
                else:
                    buf = torch.empty(shape, dtype=param.dtype, device=param.device)
                dist.broadcast(buf, group=self.group, group_src=src)
                if src != self.rank:
                    param.narrow(0, start, shape[0]).copy_(buf)

    def check_servable(self) -> None:
        if self.released_bytes:
            raise RuntimeError("the weights were released: resume them and update them before generating")
        if self.stale:
            raise RuntimeError(f"{len(self.stale)} tensors {self.stale_why}: a complete update must load them "
                               "before the engine serves")

    @torch.no_grad()
    def logits(self, input_ids: Tensor) -> Tensor:
        self.check_servable()
        device = next(self.model.parameters()).device
        return self.model(input_ids.to(device)).logits.float()

    @torch.no_grad()
    def generate(self, input_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = list(input_ids)
        out = []
        for _ in range(max_new_tokens):
            logits = self.logits(torch.tensor([ids]))
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
        return out
