"""What every trainer rank of an update shares: rank 0's answer, the first failing rank's error, and any failure
as the error every rank raises."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from weightstream.engines.base import EngineError
from weightstream.errors import UpdateError, WeightstreamError

__all__ = ["rank", "share", "as_update_error", "first_error", "committed_on"]


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def share(obj: Any) -> Any:
    """``obj`` of global rank 0, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group_src=0)
    return box[0]


def as_update_error(phase: str, exc: BaseException, engines: Sequence[str]) -> WeightstreamError:
    """``exc`` as the error every rank raises: weightstream's own errors as they are (a conversion
    problem stays a :class:`ConversionError`), anything else as an :class:`UpdateError` of ``phase``."""
    if isinstance(exc, WeightstreamError) and not isinstance(exc, EngineError):
        return exc
    return UpdateError(phase, f"{type(exc).__name__}: {exc}" if not isinstance(exc, EngineError) else str(exc), engines)


def first_error(err: BaseException | None) -> BaseException | None:
    """The lowest failing rank's error, on every rank (tagged with that rank when it is not rank 0)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return err
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, err)
    for rank, e in enumerate(everyone):
        if e is not None:
            if rank and isinstance(e, UpdateError):
                return UpdateError(e.phase, f"on trainer rank {rank}: {e.detail}", e.engines)
            return e
    return None


def committed_on(err: WeightstreamError, committed: Sequence[str], urls: Sequence[str]) -> WeightstreamError:
    """A commit that failed after some engines had committed says which (the others' sessions are aborted)."""
    if not committed or not isinstance(err, UpdateError):
        return err
    left = [u for u in urls if u not in committed]
    return UpdateError(err.phase, f"{err.detail} (committed on {list(committed)} before it failed; not on {left})",
                       err.engines)

