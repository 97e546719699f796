"""``deepspeed.comm`` on plait: DeepSpeed's communication module is a thin layer over
``torch.distributed``; scripts call ``get_rank``, ``get_world_size``, ``barrier``, ``all_reduce`` and
friends through it. They are torch's own functions here."""
from __future__ import annotations

from torch.distributed import (ReduceOp, all_gather, all_reduce, barrier, broadcast, get_rank,  # noqa: F401
                               get_world_size, is_initialized, new_group, reduce_scatter)

from plait.deepspeed.entry import init_distributed  # noqa: F401


def get_local_rank() -> int:
    """This process's index on its node (the launcher's ``LOCAL_RANK``; 0 without one)."""
    import os
    return int(os.environ.get("LOCAL_RANK", 0))


def is_available() -> bool:
    import torch.distributed as dist
    return dist.is_available()
