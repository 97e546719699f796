"""Who talks to whom: the parallel mesh, tensor-parallel collectives, RNG tracking, start-up,
and pipeline schedules as data."""

from plait.parallel.collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)
from plait.parallel.launch import LaunchInfo, init_distributed, launch_info
from plait.parallel.mesh import ParallelMesh
from plait.parallel.random import RNGTracker, checkpoint
from plait.parallel.pipeline.check import check_schedule
from plait.parallel.pipeline.registry import SCHEDULES, get_schedule, placement
from plait.parallel.pipeline.schedules import Action
from plait.parallel.pipeline.simulate import SimResult, render, simulate, stage_costs
from plait.parallel.pipeline.comm_actions import with_communication

__all__ = [
    "ParallelMesh",
    "LaunchInfo",
    "init_distributed",
    "launch_info",
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "scatter_to_sp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    "RNGTracker",
    "checkpoint",
    "Action",
    "SCHEDULES",
    "get_schedule",
    "placement",
    "check_schedule",
    "simulate",
    "SimResult",
    "render",
    "stage_costs",
    "with_communication",
]
