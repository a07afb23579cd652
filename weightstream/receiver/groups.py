"""The weight-update groups one engine rank joins, as a trainer asks (SGLang's ``/init_weights_update_group``,
decoded into an :class:`~weightstream.receiver.requests.InitGroupRequest`), by name: joined and, where the trainer
asks, warmed by a first tiny transfer (:func:`~weightstream.wire.groups.warm_group`); left one by one or all at
once. The receives over a group (:mod:`~weightstream.receiver.collective`) look it up here by name."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from weightstream.receiver.requests import InitGroupRequest
from weightstream.receiver.values import warm_checks
from weightstream.streaming.copies import warm_kernel
from weightstream.wire.groups import destroy_group, init_custom_process_group, warm_device, warm_group

__all__ = ["UpdateGroups"]


class UpdateGroups:
    """Engine rank ``rank``'s groups (its weights on ``device``): ``joined``, by name (what the receives look up),
    the trainer's store each was joined at (``masters``, named in errors), and how many were ``warmed``."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.joined: dict[str, Any] = {}
        self.masters: dict[str, str] = {}
        self.warmed = 0

    def join(self, r: InitGroupRequest) -> str:
        """Join group ``r.group_name`` as rank ``r.rank_offset`` + this rank, within ``r.timeout_s``; ``r.warm``: then
        run its first, tiny transfer with the trainer. A name held already is another trainer's: refused, and
        nothing of it touched. The loads' kernels are made ready now too (compiled, or loaded: not in an update)."""
        if r.group_name in self.joined:
            raise RuntimeError(f"weight-update group {r.group_name!r} is already held here, joined with the trainer "
                               f"at {self.masters.get(r.group_name)}: that trainer must leave it first (its "
                               "WeightSync closed), or this one use another group_name")
        master = f"tcp://{r.master_address}:{r.master_port}"
        group = init_custom_process_group(r.backend, master, r.world_size, r.rank_offset + self.rank, r.group_name,
                                          timedelta(seconds=r.timeout_s))
        if r.warm:
            try:
                warm_group(group, r.warm, r.warm_senders, warm_device(r.backend, self.device), r.timeout_s)
            except BaseException:
                destroy_group(group)
                raise
        self.joined[r.group_name], self.masters[r.group_name] = group, master
        self.warmed += bool(r.warm)
        warm_kernel(self.device)  # the loads out of kept receive buffers: compiled now, not in the first update
        warm_checks(self.device)  # and the value checks' kernels loaded
        warmed = " (warmed)" if r.warm else ""
        return f"rank {r.rank_offset + self.rank} of {r.world_size} joined {r.group_name}{warmed}"

    def leave(self, name: str) -> str:
        """Tear group ``name`` down (never raises: the trainer may be gone)."""
        destroy_group(self.joined.pop(name, None))
        self.masters.pop(name, None)
        return "destroyed"

    def leave_all(self) -> str:
        for name in list(self.joined):
            self.leave(name)
        return "destroyed"
