"""Pure, reversible tensor ops between Megatron's fused layout and Hugging Face's.

Each op turns one Megatron tensor into its HF tensors (``to_hf``) and back (``to_megatron``).
An op knows formats, never parallelism: the caller tells it, through :class:`OpContext`,
how many TP shards are concatenated in the tensor it gets (``parts``) or which single shard
it is (``shard_rank``). The ops run unchanged on ``meta`` tensors, which is how shapes are
planned before any data moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from weightstream.models.spec import ModelSpec

__all__ = [
    "OpContext", "TensorOp", "PiecewiseOp", "hf_views", "convert_into", "Identity", "SplitQKV", "SplitGated",
    "TrimVocab", "NotRepresentable", "Unrepresentable", "FusedExperts", "PerMTPLayer", "IDENTITY", "QKV", "GATED",
    "VOCAB"
]


@dataclass(frozen=True, slots=True)
class OpContext:
    spec: ModelSpec
    # Number of TP shards concatenated along the partition dim in the tensor (tp for a
    # gathered tensor, 1 for a replicated tensor or a single shard).
    parts: int = 1
    # When the tensor is one TP shard (per-rank mode): its TP rank. None for a whole tensor.
    shard_rank: int | None = None


class TensorOp(Protocol):
    """A reversible conversion between one Megatron tensor and ``arity`` HF tensors (an op whose results are
    strided views of its input is a :class:`PiecewiseOp`)."""

    @property
    def arity(self) -> int: ...

    def to_hf(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]: ...

    def to_megatron(self, parts: Sequence[Tensor], ctx: OpContext, megatron_shape: torch.Size) -> Tensor: ...


@runtime_checkable
class PiecewiseOp(TensorOp, Protocol):
    """An op whose results are strided views of its input: ``pieces(tensor, ctx)`` returns those views
    uncopied, and :func:`convert_into` writes each straight into its place in a bucket buffer, with one copy."""

    def pieces(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]: ...


def hf_views(op: TensorOp, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
    """The HF tensors of ``tensor``: uncopied views where the op makes views (:class:`PiecewiseOp`)."""
    return op.pieces(tensor, ctx) if isinstance(op, PiecewiseOp) else op.to_hf(tensor, ctx)


def _check_divisible(what: str, total: int, unit: int) -> int:
    if unit <= 0 or total % unit:
        raise ValueError(f"{what}: size {total} is not a multiple of {unit}")
    return total // unit


def convert_into(op: TensorOp, tensor: Tensor, ctx: OpContext, outs: Sequence[Tensor]) -> None:
    """Write ``op.to_hf(tensor)`` into ``outs`` (contiguous, of the HF shapes), in one copy when the
    op offers ``pieces``."""
    if isinstance(op, PiecewiseOp):
        for out, piece in zip(outs, op.pieces(tensor, ctx), strict=True):
            out.view(piece.shape).copy_(piece)
        return
    results = op.to_hf(tensor, ctx)
    for out, result in zip(outs, results, strict=True):
        if out.shape != result.shape:
            raise ValueError(f"converted shape {tuple(result.shape)} != expected {tuple(out.shape)}")
        out.copy_(result)


@dataclass(frozen=True, slots=True)
class Identity:
    """A rename: the tensor is the same in both layouts."""

    arity: int = 1

    def to_hf(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
        return [tensor]

    def to_megatron(self, parts: Sequence[Tensor], ctx: OpContext, megatron_shape: torch.Size) -> Tensor:
        return parts[0]


@dataclass(frozen=True, slots=True)
class SplitQKV:
    """Megatron's grouped ``linear_qkv`` <-> HF ``q_proj``, ``k_proj``, ``v_proj``.

    Megatron stacks, per query group, that group's query heads, then its key head, then its
    value head. Viewing the rows as ``(groups, q_per_group + 2, head_dim)`` and splitting the
    second axis into ``[q_per_group, 1, 1]`` is right for any heads/groups ratio, for a whole
    tensor and for one TP shard alike (a shard holds whole groups).
    """

    arity: int = 3

    def pieces(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
        """q, k, v as ``(groups, heads, head_dim, ...)`` views of ``tensor``."""
        qpg, hd = ctx.spec.q_per_group, ctx.spec.head_dim
        groups = _check_divisible("linear_qkv rows", tensor.shape[0], (qpg + 2) * hd)
        grouped = tensor.reshape(groups, qpg + 2, hd, *tensor.shape[1:])
        return list(torch.split(grouped, [qpg, 1, 1], dim=1))

    def to_hf(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
        return [x.reshape(-1, *tensor.shape[1:]) for x in self.pieces(tensor, ctx)]

    def to_megatron(self, parts: Sequence[Tensor], ctx: OpContext, megatron_shape: torch.Size) -> Tensor:
        q, k, v = parts
        qpg, hd = ctx.spec.q_per_group, ctx.spec.head_dim
        rest = tuple(q.shape[1:])
        groups = _check_divisible("k_proj rows", k.shape[0], hd)
        fused = torch.cat(
            [q.reshape(groups, qpg, hd, *rest), k.reshape(groups, 1, hd, *rest), v.reshape(groups, 1, hd, *rest)],
            dim=1,
        )
        return fused.reshape(-1, *rest)


@dataclass(frozen=True, slots=True)
class SplitGated:
    """Megatron's gated ``linear_fc1`` <-> HF ``gate_proj``, ``up_proj``.

    Each TP shard is ``[gate_r; up_r]``, so a gathered tensor is ``[gate_0; up_0; gate_1; up_1; ...]``:
    cut it into ``parts`` shards first, then halve each.
    """

    arity: int = 2

    def pieces(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
        """gate, up as ``(parts, rows, ...)`` views of ``tensor``."""
        rows = _check_divisible("linear_fc1 rows", tensor.shape[0], 2 * ctx.parts)
        halves = tensor.reshape(ctx.parts, 2, rows, *tensor.shape[1:])
        return [halves[:, 0], halves[:, 1]]

    def to_hf(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
        return [x.reshape(-1, *tensor.shape[1:]) for x in self.pieces(tensor, ctx)]

    def to_megatron(self, parts: Sequence[Tensor], ctx: OpContext, megatron_shape: torch.Size) -> Tensor:
        gate, up = parts
        rest = tuple(gate.shape[1:])
        rows = _check_divisible("gate_proj rows", gate.shape[0], ctx.parts)
        stacked = torch.stack([gate.reshape(ctx.parts, rows, *rest), up.reshape(ctx.parts, rows, *rest)], dim=1)
        return stacked.reshape(-1, *rest)


@dataclass(frozen=True, slots=True)
class TrimVocab:
    """Megatron's padded vocabulary rows <-> HF's ``vocab_size`` rows.

    For one TP shard (rank r of a tensor whose shards hold ``L`` rows each), the rows kept are
    those of ``[r * L, min((r + 1) * L, vocab_size))``; a shard made only of padding keeps none.
    """

    arity: int = 1

    def to_hf(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
        vocab = ctx.spec.vocab_size
        if ctx.shard_rank is None:
            if tensor.shape[0] < vocab:
                raise ValueError(f"vocabulary rows: {tensor.shape[0]} < vocab_size {vocab}")
            return [tensor.narrow(0, 0, vocab)]
        rows = tensor.shape[0]
        keep = max(0, min(rows, vocab - ctx.shard_rank * rows))
        return [tensor.narrow(0, 0, keep)]

    def to_megatron(self, parts: Sequence[Tensor], ctx: OpContext, megatron_shape: torch.Size) -> Tensor:
        (tensor,) = parts
        padded = megatron_shape[0]
        if padded < tensor.shape[0]:
            raise ValueError(f"vocabulary rows: Megatron holds {padded} < HF {tensor.shape[0]}")
        if padded == tensor.shape[0]:
            return tensor
        out = tensor.new_zeros((padded, *tensor.shape[1:]))
        out[: tensor.shape[0]] = tensor
        return out


class NotRepresentable(ValueError):
    """A Megatron tensor that the HF layout has no place for (raised by :class:`Unrepresentable`)."""


@dataclass(frozen=True, slots=True)
class Unrepresentable:
    """A Megatron tensor the HF model has no place for, and that changes what the model computes:
    converting it either way raises :class:`NotRepresentable` with ``reason``, so that a model that
    holds it is refused rather than streamed without it."""

    reason: str
    arity: int = 0

    def to_hf(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
        raise NotRepresentable(self.reason)

    def to_megatron(self, parts: Sequence[Tensor], ctx: OpContext, megatron_shape: torch.Size) -> Tensor:
        raise NotRepresentable(self.reason)


@dataclass(frozen=True, slots=True)
class FusedExperts:
    """transformers' fused expert parameter ``(E, rows, cols)`` <-> one HF tensor per expert (and per part).

    ``parts=2``: ``gate_up_proj`` of shape ``(E, 2I, H)``, expert e's rows ``[0, I)`` its ``gate_proj`` and
    ``[I, 2I)`` its ``up_proj``; ``parts=1``: ``down_proj`` of shape ``(E, H, I)``, expert e's slice its
    ``down_proj``. Tensors are made expert by expert (gate, up of expert 0, then of expert 1, ...), as
    views of the fused parameter.
    """

    parts: int = 1

    @property
    def arity(self) -> int:  # per expert
        return self.parts

    def to_hf(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
        experts = ctx.spec.num_experts
        if tensor.dim() != 3 or tensor.shape[0] != experts:
            raise ValueError(f"fused experts: expected ({experts}, rows, cols), got {tuple(tensor.shape)}")
        rows = _check_divisible("fused expert rows", tensor.shape[1], self.parts)
        return [tensor[e].narrow(0, p * rows, rows) for e in range(experts) for p in range(self.parts)]

    def to_megatron(self, parts: Sequence[Tensor], ctx: OpContext, megatron_shape: torch.Size) -> Tensor:
        per = [torch.cat(list(parts[e * self.parts : (e + 1) * self.parts]), dim=0)
               for e in range(len(parts) // self.parts)]
        return torch.stack(per, dim=0)


@dataclass(frozen=True, slots=True)
class PerMTPLayer:
    """``inner``'s HF tensor, then the same tensor again for each multi-token prediction layer of the spec
    (``mtp_layers``): DeepSeek-V3's checkpoints keep, in every MTP layer, a copy of the embedding and of the output
    layer (the mapping's second name holds ``{mtp}``). Back to Megatron: every copy must equal the tensor."""

    inner: TensorOp
    arity: int = 2  # the tensor's name and its copies' pattern

    def to_hf(self, tensor: Tensor, ctx: OpContext) -> list[Tensor]:
        (out,) = self.inner.to_hf(tensor, ctx)
        return [out] * (1 + ctx.spec.mtp_layers)

    def to_megatron(self, parts: Sequence[Tensor], ctx: OpContext, megatron_shape: torch.Size) -> Tensor:
        first, *copies = parts
        differ = [k for k, c in enumerate(copies) if c.shape != first.shape or not torch.equal(c, first)]
        if differ:
            raise ValueError(f"the copies held by MTP layers {differ} differ from the tensor they copy")
        return self.inner.to_megatron([first], ctx, megatron_shape)


IDENTITY = Identity()
QKV = SplitQKV()
GATED = SplitGated()
VOCAB = TrimVocab()
