"""The collectives whose names changed across the torch releases we support, in one place."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat"]


# torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and deprecated the old name; the GPU
# machines we benchmark on run torch 2.11, which has only the old one.
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_all_gather_flat = dist.all_gather_single if _TORCH >= (2, 13) else dist.all_gather_into_tensor


def all_gather_flat(output: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank's ``send`` (equal sizes) concatenated in rank order into ``output``."""
    _all_gather_flat(output, send, group=group)
