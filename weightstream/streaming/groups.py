"""Process groups between a trainer and engines, made outside the default world.

Both sides call :func:`init_custom_process_group` with the same address, world size and group
name, concurrently: rank 0 (the trainer's sender) hosts the TCP store, everyone else connects,
and the store is prefixed by the group name (what SGLang's receiver does), so several groups can
share one address. The rendezvous is bounded by ``timeout``: a peer that never comes ends in an
error, not a hang.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch.distributed as dist


class GroupError(RuntimeError):
    pass


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta | float = 60.0,
):
    """A process group of ``world_size`` ranks that is not part of the default world."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if not group_name:
        raise ValueError("group_name must not be empty")
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    try:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
        params = inspect.signature(_new_process_group_helper).parameters
        options = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
        if "device_id" in params:
            options["device_id"] = None
        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **options
        )
    except Exception as exc:  # noqa: BLE001 — re-raised with the group named
        raise GroupError(
            f"could not form process group {group_name!r} ({backend}, {init_method}, rank {rank} of {world_size}) "
            f"within {timeout.total_seconds():.0f} s: {exc}"
        ) from exc
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(group) -> None:
    """Tear a custom group down; never raises (it is called on error paths)."""
    if group is None:
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001
        pass
