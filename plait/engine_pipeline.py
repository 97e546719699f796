"""One training step of the engine through a ``PipelineParallel``: ZeRO's loss scaling and micro-step
count go into the schedule as callbacks, and the tied copies' gradients are summed where ZeRO keeps
them (``.grad`` at stages 0-1, the fp32 gradient shards at stages 2-3) through the pipeline's one
``sum_tied_gradients``."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from plait.parallel.mesh import ParallelMesh
from plait.parallel.pipeline import PipelineParallel
from plait.parallel.sharding import shard_of
from plait.zero import ZeroOptimizer


def pipeline_train_step(pipeline: PipelineParallel, zero: ZeroOptimizer, mesh: ParallelMesh,
                        batches: list[dict]) -> torch.Tensor:
    """Forward and backward of ``batches`` (``pipeline.m`` micro-batch dicts) through the schedule, each
    micro-batch's loss scaled by ``zero.scale_loss`` and counted by ``zero.note_micro_step``, then the tied
    gradients summed. Collective over the pipeline (and the dp ranks at ZeRO stages 2-3).

    Returns:
        This dp replica's mean loss over the micro-batches: float32, shape ``[]``, on the device.
    """
    loss = pipeline.train_batch(iter(batches), scale_loss=zero.scale_loss, on_micro_batch=zero.note_micro_step,
                                sum_tied=False)
    sum_tied_gradients(pipeline, zero, mesh)
    return loss


@torch.no_grad()
def sum_tied_gradients(pipeline: PipelineParallel, zero: ZeroOptimizer, mesh: ParallelMesh) -> None:
    """Sum the tied copies' gradients (the embedding on the first stage, its head copy on the last).

    ZeRO stages 0-1 keep them in ``.grad``. At stages 2-3 they were reduce-scattered during backward:
    each copy's whole dp-reduced gradient is rebuilt from the dp ranks' pieces of the fp32 gradient
    shards, the copies are summed, and this rank keeps its pieces. Linear, so equal to summing before
    the reduction.
    """
    tied = pipeline.tied_parameters
    if not tied:
        return
    if zero.stage < 2:
        pipeline.sum_tied_gradients()
        return
    zero.reducer.wait()
    fulls, where = [], []
    for param in tied:
        numel = math.prod(shard_of(param).local_shape)      # param.numel() is 0 under ZeRO-3
        full = torch.zeros(numel, dtype=torch.float32, device=mesh.device)
        pieces = [(pc, gi) for gi, g in enumerate(zero.groups) for pc in g.pieces() if pc.slot.param is param]
        for pc, gi in pieces:
            full[pc.start:pc.start + pc.length] = zero.grad_shards[gi][pc.shard_offset:pc.shard_offset + pc.length]
        if zero.dp_size > 1:
            dist.all_reduce(full, group=mesh.dp_group)
        fulls.append(full)
        where.append(pieces)
    pipeline.sum_tied_gradients(fulls)
    for full, pieces in zip(fulls, where):
        for pc, gi in pieces:
            zero.grad_shards[gi][pc.shard_offset:pc.shard_offset + pc.length] = full[pc.start:pc.start + pc.length]
