"""What a ZeRO stage partitions, and the communication knobs of ``ZeroOptimizer``.

Rajbhandari et al., "ZeRO", SC'20, Sec. 5: stage 1 (P_os) partitions the optimizer states (here with
the fp32 master weights) over the N_d data-parallel ranks, stage 2 (P_os+g) also the gradients,
stage 3 (P_os+g+p) also the parameters; stage 0 is plain data parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.zero.precision import resolve_dtype


@dataclass(frozen=True)
class StagePolicy:
    """Which model states a ZeRO ``stage`` shards over dp; built once (``StagePolicy.of``).

    Attributes:
        stage: 0, 1, 2 or 3.
        optimizer_states: fp32 masters and optimizer state are sharded (stages 1-3); else every rank
            holds them whole and the gradient is all-reduced.
        gradients: gradients are reduce-scattered during backward, from parameter hooks, and no full
            gradient is kept (stages 2-3); else ``param.grad`` accumulates and is reduced at the boundary.
        parameters: compute-dtype parameters are sharded and all-gathered per unit around use (stage 3).
    """

    stage: int
    optimizer_states: bool
    gradients: bool
    parameters: bool

    @classmethod
    def of(cls, stage: int) -> StagePolicy:
        """Raises ValueError unless ``stage`` is 0, 1, 2 or 3."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        return cls(stage, stage >= 1, stage >= 2, stage == 3)

    def shard_world(self, dp_size: int, dp_rank: int) -> tuple[int, int]:
        """``(world, rank)`` the flat segments are split over: ``(1, 0)`` when nothing is sharded."""
        return (dp_size, dp_rank) if self.optimizer_states else (1, 0)


@dataclass(frozen=True)
class CommOptions:
    """Communication knobs of ``ZeroOptimizer`` (DeepSpeed's ``zero_optimization`` keys of the same names).

    Args:
        reduce_dtype: dtype gradients are reduced in ("fp32", "bf16", "fp16" or a torch dtype).
        reduce_bucket_size: elements per segment, i.e. per gradient reduce-scatter/all-reduce (>= 1).
        allgather_bucket_size: elements per coalesced parameter all-gather (>= 1).
        overlap_comm: asynchronous collectives (reduction overlaps backward; all-gathers overlap each other).
        prefetch_bucket_size: stage 3: elements all-gathered ahead of use (0: no prefetch).
        param_persistence_threshold: stage 3: parameters with fewer elements stay whole on every rank.

    Raises:
        ValueError: a bucket size below 1 element.
    """

    reduce_dtype: torch.dtype | str = torch.float32
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000

    def __post_init__(self):
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1 element, got {getattr(self, name)}")
        object.__setattr__(self, "reduce_dtype", resolve_dtype(self.reduce_dtype))
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            object.__setattr__(self, name, int(getattr(self, name)))
