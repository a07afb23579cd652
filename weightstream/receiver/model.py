"""What a model must offer to take updates through this layer: its tensors' destinations for a bucket's names,
the load of named tensors, and the session an update runs in (begun, prepared, committed or rolled back whole).
The reference engine's :class:`~weightstream.reference_engine.model.ShardedCausalLM` is one; a model inside
another engine (vLLM's, behind :mod:`weightstream.integrations.vllm_backend`) is another."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from torch import Tensor

from weightstream.receiver.backups import BackupPlace
from weightstream.receiver.pieces import Weight
from weightstream.streaming.bucket import TensorMeta

__all__ = ["Loaded", "LoadableModel"]


class Loaded(Protocol):
    """What a load answers: the names loaded, and every problem (nothing loaded where there is one)."""

    @property
    def loaded(self) -> Sequence[str]: ...

    @property
    def problems(self) -> Sequence[str]: ...


class LoadableModel(Protocol):
    """A model an update loads into, rank by rank."""

    # checkpoint name -> (this rank's tensor, the dim it is split on or None)
    params: dict[str, tuple[Tensor, int | None]]
    # the one rank that holds each tensor held by one rank alone (experts under expert parallelism)
    elsewhere: Mapping[str, int]

    def whole_targets(self, metas: Sequence[TensorMeta]) -> list[Tensor] | None:
        """Each tensor's parameter as a flat view, where every tensor of a bucket loads by a plain copy; else None."""
        ...

    def piece_targets(self, metas: Sequence[TensorMeta]) -> list[Tensor] | None:
        """The view of this rank's parameter each piece of a resharded bucket fills; None where any needs more."""
        ...

    def load_flat(self, names: Sequence[str], targets: Sequence[list[Tensor]],
                  copies: Sequence[Callable[[], Any]]) -> Loaded:
        """Run ``copies`` into ``targets`` (from :meth:`whole_targets`), backing up what they overwrite first."""
        ...

    def load_weights(self, weights: Iterable[Weight]) -> Loaded:
        """Load named tensors (whole, or a shard of one), each narrowed to this rank's part."""
        ...

    def begin_session(self) -> BackupPlace:
        """Open an update's session; where its rollback copies go."""
        ...

    def prepare_session(self) -> None:
        """Do what could still fail at a commit, undoably."""
        ...

    def commit_session(self) -> None:
        """Keep what the session loaded."""
        ...

    def rollback_session(self) -> int:
        """Put back what the session overwrote; how many tensors."""
        ...
