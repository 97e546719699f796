"""Who talks to whom: the parallel mesh, tensor-parallel collectives, RNG tracking, start-up."""
from plait.parallel.collectives import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                                        reduce_scatter_to_sp, scatter_to_sp, scatter_to_tp)
from plait.parallel.launch import LaunchInfo, init_distributed, launch_info
from plait.parallel.mesh import ParallelMesh

__all__ = [
    "ParallelMesh", "LaunchInfo", "init_distributed", "launch_info", "copy_to_tp", "reduce_from_tp",
    "scatter_to_tp", "gather_from_tp", "scatter_to_sp", "gather_from_sp", "reduce_scatter_to_sp",
]
