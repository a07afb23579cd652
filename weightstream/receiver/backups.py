"""Where an update session keeps its rollback copies: beside the weights when they fit there, else in host memory,
else nowhere — decided when the session begins, from the memory free at that moment, and said.

A session backs up each tensor it overwrites, the first time it does: a full update keeps a copy of every weight
until the commit. On a GPU beside a large model (a 61 GB Qwen3-30B-A3B on an 80 GB card, with receive buffers
and a KV cache) that copy does not fit, so it goes to host memory (pinned: copied out at the device's bandwidth to
the host), and where the host has no room either the session keeps none: an aborted update then leaves the
engine refusing to serve until a complete update, as an engine without rollback does (never a mix served).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DEVICE_RESERVE_BYTES", "HOST_RESERVE_BYTES", "BackupPlace", "backup_place", "host_available_bytes",
           "allocated_bytes", "place_for"]

DEVICE_RESERVE_BYTES = 4 << 30  # device memory a session leaves free beyond its backups: buffers, activations
HOST_RESERVE_BYTES = 8 << 30  # host memory it leaves free beyond them

PLACES = ("device", "host", "none")


@dataclass(frozen=True, slots=True)
class BackupPlace:
    """Where one session's rollback copies go (``device``: beside the weights; ``host``: host memory; ``none``:
    nowhere, an abort leaves what it loaded stale), and why, in words."""

    where: str
    why: str

    def __post_init__(self) -> None:
        if self.where not in PLACES:
            raise ValueError(f"a backup place is one of {PLACES}, not {self.where!r}")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def backup_place(weight_bytes: int, on_gpu: bool, device_free: int, host_free: int) -> BackupPlace:
    """The place for a session that may back up ``weight_bytes`` of weights held on a GPU (``on_gpu``) or in host
    memory, with ``device_free`` and ``host_free`` bytes available now."""
    copies = f"{_gib(weight_bytes)} of copies"
    if not on_gpu:
        if weight_bytes <= host_free:
            return BackupPlace("device", f"{copies} kept beside the weights, in host memory")
        return _nowhere(f"{copies} do not fit in host memory ({_gib(host_free)} available)")
    if weight_bytes + DEVICE_RESERVE_BYTES <= device_free:
        return BackupPlace("device", f"{copies} fit beside the weights ({_gib(device_free)} free on the GPU)")
    short = f"the GPU has {_gib(device_free)} free, less than {copies} and a {_gib(DEVICE_RESERVE_BYTES)} reserve"
    if weight_bytes + HOST_RESERVE_BYTES <= host_free:
        return BackupPlace("host", f"{short}: kept in host memory")
    return _nowhere(f"{short}, and host memory has {_gib(host_free)} available")


def _nowhere(why: str) -> BackupPlace:
    return BackupPlace("none", f"{why}: this session keeps no rollback copy, and an aborted update leaves the engine "
                               "refusing to serve until a complete one")


def host_available_bytes() -> int:
    """What the kernel says host memory can still give (``MemAvailable``)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def allocated_bytes(device: torch.device) -> int:
    """What torch's allocator has handed out on ``device`` (a GPU), as ``torch.cuda.memory_allocated`` says, read from
    the allocator's statistics as they come (that call flattens and sorts all of them first: about 0.2 ms on an H200,
    at the start of every update's session)."""
    return int(torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["current"])


def place_for(weight_bytes: int, device: torch.device) -> BackupPlace:
    """:func:`backup_place` with the memory free now on ``device`` (what the device has free, and what torch's
    allocator holds reserved but unused, which it gives the copies first) and on the host."""
    on_gpu = device.type == "cuda"
    device_free = 0
    if on_gpu:
        device_free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - allocated_bytes(device)
    return backup_place(weight_bytes, on_gpu, device_free, host_available_bytes())
