"""``deepspeed.comm`` on plait: DeepSpeed's communication module is a thin layer over
``torch.distributed``; scripts call ``get_rank``, ``get_world_size``, ``barrier``, ``all_reduce`` and
friends through it. They are torch's own functions here."""

from __future__ import annotations

from torch.distributed import (
    ReduceOp,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    get_rank,  # noqa: F401
    get_world_size,
    is_initialized,
    new_group,
    reduce_scatter,
)

from plait.deepspeed.entry import init_distributed  # noqa: F401
from plait.parallel.launch import launch_info


def get_local_rank() -> int:
    """This process's index on its node (torchrun's ``LOCAL_RANK`` or SLURM's ``SLURM_LOCALID``; 0 without)."""
    return launch_info().local_rank


def is_available() -> bool:
    import torch.distributed as dist

    return dist.is_available()
