"""One training step of the engine through a ``PipelineParallel``: ZeRO's loss scaling and micro-step
count go into the schedule as callbacks, and the tied copies' gradients are summed where ZeRO keeps
them (``plait.zero.whole_gradients``) through the pipeline's one ``sum_tied_gradients``.

Under ZeRO-Offload (``zero_optimization.offload_optimizer``) stages 2-3 land each reduced gradient in a host
shard from a worker thread during backward, so the tied sum first waits for those landings
(``settle_landings``); the engine builds the offload with ``OffloadOptions(final_at_step=True)``
(``plait.engine.offload``), so no norm or host step reads a gradient before that sum (``plait.zero.offload``)."""

from __future__ import annotations

import torch

from plait.config import ConfigError, PlaitConfig
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.zero import ZeroOptimizer, whole_gradients
from plait.zero.offload import HostStepper


def pipeline_train_step(
    pipeline: PipelineParallel, zero: ZeroOptimizer, batches: list[dict]
) -> torch.Tensor:
    """Forward and backward of ``batches`` (``pipeline.m`` micro-batch dicts) through the schedule, each
    micro-batch's loss scaled by ``zero.scale_loss`` and counted by ``zero.note_micro_step``, then the tied
    gradients summed. Collective over the pipeline (and the dp ranks at ZeRO stages 2-3).

    Returns:
        This dp replica's mean loss over the micro-batches: float32, shape ``[]``, on the device.
    """
    loss = pipeline.train_batch(
        iter(batches),
        scale_loss=zero.scale_loss,
        on_micro_batch=zero.note_micro_step,
        sum_tied=False,
    )
    sum_tied_gradients(pipeline, zero)
    return loss


def sum_tied_gradients(pipeline: PipelineParallel, zero: ZeroOptimizer) -> None:
    """Sum the tied copies' gradients (the embedding on the first stage, its head copy on the last)
    wherever the ZeRO stage keeps them (``plait.zero.whole_gradients``), through the pipeline's one
    ``sum_tied_gradients``. Collective over the pipeline's tied group (and dp at stages 2-3)."""
    if pipeline.tied_parameters:
        settle_landings(zero)
        with whole_gradients(zero, pipeline.tied_parameters) as grads:
            pipeline.sum_tied_gradients(grads)


def settle_landings(zero: ZeroOptimizer) -> None:
    """ZeRO-Offload at stages 2-3: wait until every gradient reduced so far is in the host gradient shards
    (the reductions landed, the worker's device->host copies and accumulations done), so that code editing
    those shards between backward and ``step()`` reads and writes whole values. A no-op otherwise (stage 1
    keeps gradients in ``.grad`` until the step). Collective over dp where reductions are still in flight.

    Raises:
        RuntimeError: ``zero``'s host stepper lands gradients as final during backward (it was built
            without ``OffloadOptions(final_at_step=True)``): an edit after backward would miss their norms
            and early host steps.
    """
    stepper = zero.stepper
    if not isinstance(stepper, HostStepper) or not zero.policy.gradients:
        return
    if not stepper.options.final_at_step:
        raise RuntimeError(
            "the ZeRO-Offload gradients are final when they land during backward, so editing them "
            "afterwards (a pipeline's tied-embedding sum) would miss their norms and host steps; "
            "build the ZeroOptimizer with OffloadOptions(final_at_step=True)"
        )
    zero.reducer.wait()
    stepper.drain()


def check_pipeline(pipeline: PipelineParallel, config: PlaitConfig) -> None:
    """ConfigError where the ``PipelineParallel`` the user built disagrees with the config (micro-batches per step,
    schedule costs, CUDA graphs), naming both values and the fix."""
    if pipeline.m != config.gradient_accumulation_steps:
        raise ConfigError(
            f"the pipeline runs micro_batches={pipeline.m} per step but the config has "
            f"gradient_accumulation_steps={config.gradient_accumulation_steps}; make them equal"
        )
    if config.pipeline.schedule_costs == "measure" and pipeline.schedule_costs != "measure":
        raise ConfigError(
            "the config has pipeline.schedule_costs 'measure' but the PipelineParallel was built "
            f"with schedule_costs={pipeline.schedule_costs!r}; pass schedule_costs='measure'"
        )
    if config.pipeline.cuda_graphs and not pipeline.cuda_graphs:
        raise ConfigError(
            "the config has pipeline.cuda_graphs true but the PipelineParallel was built without "
            "it; pass cuda_graphs=True"
        )
