"""What a model must offer to take updates through this layer: the destinations of a bucket's tensors (where each
loads by a plain copy), the load of named tensors, and the session an update runs in (begun, committed or rolled back
whole). The reference engine's :class:`~weightstream.reference_engine.model.ShardedCausalLM` is one; a model inside
vLLM (:class:`~weightstream.integrations.vllm_backend.VllmModel`) is another."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from torch import Tensor

from weightstream.receiver.backups import BackupPlace
from weightstream.receiver.pieces import Weight
from weightstream.receiver.programs import CopyProgram, copy_program
from weightstream.streaming.bucket import TensorMeta

__all__ = ["Loaded", "LoadableModel", "HeldModel", "program_for"]


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


class HeldModel(LoadableModel, Protocol):
    """A model whose weights this layer holds views of and writes into itself (the reference engine's): besides a
    :class:`LoadableModel`'s load and session, the table of its parameters, copies into them made ahead, a trainer's
    writes straight into them, and a commit's first phase."""

    @property
    def params(self) -> Mapping[str, tuple[Tensor, int | None]]:
        """This rank's parameters by checkpoint name: (its tensor, the dim it is split on over the ranks or None)."""
        ...

    @property
    def elsewhere(self) -> Mapping[str, int]:
        """The tensors another rank holds alone (experts under expert parallelism), by their owner."""
        ...

    @property
    def released_bytes(self) -> int:
        """The bytes of weights released (0: the weights are there to load into)."""
        ...

    @property
    def rollback(self) -> bool:
        """Whether a session backs up what it overwrites (off: an aborted session leaves weights stale)."""
        ...

    def piece_targets(self, metas: Sequence[TensorMeta]) -> list[Tensor] | None:
        """For a resharded bucket's pieces (checked to tile this rank's parts): the view of a parameter each piece
        fills by a plain copy, in order; None where any needs more (they then go through :meth:`load_weights`)."""
        ...

    def load_flat(self, names: Sequence[str], targets: Sequence[list[Tensor]],
                  copies: Sequence[Callable[[], Any]]) -> Loaded:
        """Run ``copies`` into ``targets`` (flat views from :meth:`whole_targets`, per dtype; ``names`` of all of
        them in order), the session's backups of them kept first."""
        ...

    def begin_writes(self, names: Sequence[str], targets: Sequence[Tensor]) -> None:
        """A colocated trainer is about to write ``names`` straight into ``targets``: back them up first, and count
        them as loaded by the session."""
        ...

    def prepare_session(self) -> None:
        """What could still fail at a commit, done now and undoable (the session stays open, restorable)."""
        ...


def program_for(model: LoadableModel, metas: Sequence[TensorMeta], key: tuple | None = None) -> CopyProgram:
    """The copy program of a bucket of ``metas`` into ``model`` (:func:`~weightstream.receiver.programs.copy_program`
    of its :meth:`~LoadableModel.whole_targets`)."""
    return copy_program(metas, model.whole_targets(metas) if metas else None, key)
