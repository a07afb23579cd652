"""Where this rank sits: its groups and coordinates in TP, PP, EP and expert-TP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    dp_rank: int = 0  # data-parallel replica (with context parallelism): each holds every shard of the model
    dp_size: int = 1  # data-parallel replicas: P2P into several engines has engine j's buckets sent by replica j % dp
    tp_group: Any = None
    pp_group: Any = None
    ep_group: Any = None
    etp_group: Any = None
    # The group over which ranks exchange metadata (the whole job by default).
    world_group: Any = None

    @property
    def coords(self) -> tuple[int, int, int, int]:
        return (self.pp_rank, self.tp_rank, self.ep_rank, self.etp_rank)

    def group_size(self, which: str) -> int:
        return {"tp": self.tp_size, "etp": self.etp_size}[which]

    def group_rank(self, which: str) -> int:
        return {"tp": self.tp_rank, "etp": self.etp_rank}[which]

    def group(self, which: str):
        return {"tp": self.tp_group, "etp": self.etp_group, "pp": self.pp_group, "ep": self.ep_group}[which]

    @classmethod
    def current(cls) -> Topology:
        """Read from ``megatron.core.parallel_state``; a single process without it is TP=PP=EP=1."""
        if not dist.is_available() or not dist.is_initialized():
            return cls()
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            if dist.get_world_size() == 1:
                return cls()
            raise RuntimeError(
                "torch.distributed has several ranks but megatron.core.parallel_state is not initialised; "
                "call parallel_state.initialize_model_parallel(...) first"
            )
        return cls(
            tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            dp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            ep_group=ps.get_expert_model_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
            world_group=dist.group.WORLD,
        )
