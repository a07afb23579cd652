"""What a model must offer to take updates through this layer: the destinations of a bucket's tensors (where each
loads by a plain copy), the load of named tensors, and the session an update runs in (begun, committed or rolled back
whole). The reference engine's :class:`~weightstream.reference_engine.model.ShardedCausalLM` is one; a model inside
vLLM (:class:`~weightstream.integrations.vllm_backend.VllmModel`) is another."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from torch import Tensor

from weightstream.receiver.backups import BackupPlace
from weightstream.receiver.pieces import Weight
from weightstream.receiver.programs import CopyProgram, copy_program
from weightstream.streaming.bucket import TensorMeta

__all__ = ["Loaded", "LoadableModel", "program_for"]


class Loaded(Protocol):
    """What a load answers: the names loaded, and every problem (nothing loaded where there is one)."""

    @property
    def loaded(self) -> Sequence[str]: ...

    @property
    def problems(self) -> Sequence[str]: ...


class LoadableModel(Protocol):
    """A model an update loads into, rank by rank."""

    def whole_targets(self, metas: Sequence[TensorMeta]) -> list[Tensor] | None:
        """Each tensor's destination (its parameter as a flat view) where every tensor of a bucket loads by a plain
        copy; None where any needs more, which then goes through :meth:`load_weights`."""
        ...

    def load_weights(self, weights: Iterable[Weight]) -> Loaded:
        """Load named tensors (whole, or a shard of one: ``(name, tensor, shard or None)``)."""
        ...

    def begin_session(self) -> BackupPlace:
        """Open an update's session; where its rollback copies go."""
        ...

    def commit_session(self) -> None:
        """Keep what the session loaded."""
        ...

    def rollback_session(self) -> int:
        """End the session without keeping it: put back what it overwrote where it can; how many tensors."""
        ...


def program_for(model: LoadableModel, metas: Sequence[TensorMeta], key: tuple | None = None) -> CopyProgram:
    """The copy program of a bucket of ``metas`` into ``model`` (:func:`~weightstream.receiver.programs.copy_program`
    of its :meth:`~LoadableModel.whole_targets`)."""
    return copy_program(metas, model.whole_targets(metas) if metas else None, key)
