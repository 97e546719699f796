"""One training step of the engine through a ``PipelineParallel``: ZeRO's loss scaling and micro-step
count go into the schedule as callbacks, and the tied copies' gradients are summed where ZeRO keeps
them (``plait.zero.whole_gradients``) through the pipeline's one ``sum_tied_gradients``."""
from __future__ import annotations

import torch

from plait.parallel.pipeline import PipelineParallel
from plait.zero import ZeroOptimizer, whole_gradients


def pipeline_train_step(pipeline: PipelineParallel, zero: ZeroOptimizer, batches: list[dict]) -> torch.Tensor:
    """Forward and backward of ``batches`` (``pipeline.m`` micro-batch dicts) through the schedule, each
    micro-batch's loss scaled by ``zero.scale_loss`` and counted by ``zero.note_micro_step``, then the tied
    gradients summed. Collective over the pipeline (and the dp ranks at ZeRO stages 2-3).

    Returns:
        This dp replica's mean loss over the micro-batches: float32, shape ``[]``, on the device.
    """
    loss = pipeline.train_batch(iter(batches), scale_loss=zero.scale_loss, on_micro_batch=zero.note_micro_step,
                                sum_tied=False)
    sum_tied_gradients(pipeline, zero)
    return loss


def sum_tied_gradients(pipeline: PipelineParallel, zero: ZeroOptimizer) -> None:
    """Sum the tied copies' gradients (the embedding on the first stage, its head copy on the last)
    wherever the ZeRO stage keeps them (``plait.zero.whole_gradients``), through the pipeline's one
    ``sum_tied_gradients``. Collective over the pipeline's tied group (and dp at stages 2-3)."""
    if pipeline.tied_parameters:
        with whole_gradients(zero, pipeline.tied_parameters) as grads:
            pipeline.sum_tied_gradients(grads)
