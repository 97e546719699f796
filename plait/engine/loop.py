"""One global batch through an ``Engine`` (``plait.engine.core``): its micro-batches pulled and checked
(``RunGuard.pull``), forward and backward per micro-batch or through the pipeline's schedule, and the step;
the loss a micro-batch's backward takes. The order is ``docs/architecture.md``'s "One training step"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait.config import ConfigError
from plait.engine.batch import to_half
from plait.engine.context import shard_batch
from plait.engine.model import loss_of, to_device
from plait.engine.pipeline import pipeline_train_step
from plait.optim.factory import NO_OPTIMIZER

if TYPE_CHECKING:
    from plait.engine.core import Engine


def micro_backward(engine: Engine, loss, scale_wrt_gas: bool) -> None:
    """``Engine.backward``: checks ``loss`` (ValueError unless a scalar tensor: a model given no ``labels`` returns
    its logits; ConfigError without an optimizer), notes it for the guard and the report, then the optimizer's
    backward, timed."""
    if not torch.is_tensor(loss) or loss.dim() != 0:
        shape = list(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(
            f"engine.backward needs the micro-batch's scalar mean loss, got {shape}; a model given "
            "no 'labels' returns its logits: put the labels in the batch"
        )
    if engine.forward_only:
        raise ConfigError(NO_OPTIMIZER)
    engine.guard.loss = loss.detach()
    engine.report.add_micro_loss(loss)
    with engine.report.timed("backward"):
        engine.optimizer.backward(loss, scale_wrt_gas=scale_wrt_gas)


def model_inputs(engine: Engine, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What ``Engine.forward`` hands the model: the screened keyword tensors cut to this cp rank's chunks, fp16
    under ``fp16.auto_cast``, and the mixture-of-experts layers' loss scale."""
    kwargs = shard_batch(
        engine.guard.screen(kwargs), engine.mesh, args
    )  # context parallel: this rank's chunks
    engine.optimizer.rebind_views()
    if engine.config.fp16.enabled and engine.config.fp16.auto_cast:
        args, kwargs = to_half(args), to_half(kwargs)
    # mixture-of-experts layers join their losses to the gradient scaled as backward scales the loss
    opt = engine.optimizer
    return args, engine.experts.forward_kwargs(
        kwargs, opt.loss_scale / opt.gradient_accumulation_steps
    )


def optimizer_step(engine: Engine) -> bool:
    """At an accumulation boundary: the guard's check of the step's micro-batches (one all-reduce), then the
    optimizer's step, timed; returns whether it applied."""
    engine.guard.before_step()
    with engine.report.timed("step"):
        return engine.optimizer.step()


def after_step(engine: Engine) -> None:
    """What follows the optimizer at an accumulation boundary: the guard's verdict, then (applied steps) the
    experts' balancing and the schedule, then the report and the garbage-collection schedule."""
    engine.guard.after_step(engine.step_applied, engine.global_steps)
    if engine.step_applied:
        engine.experts.after_step()
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
    engine.report.after_step(
        global_steps=engine.global_steps,
        global_samples=engine.global_samples,
        skipped_steps=engine.skipped_steps,
        lrs=engine.get_lr(),
        moms=engine.get_mom(),
        loss_scale=engine.loss_scale if engine.config.fp16.enabled else None,
    )
    engine.collections.after_step(
        engine.global_steps
    )  # applied and skipped steps, as every rank counts


def pull(engine: Engine, data_iter, check: bool = False) -> list[dict]:
    """The step's micro-batches (``RunGuard.pull``), checked with a pipeline or ``check`` (evaluation); with a
    pipeline each is cut to this cp rank's chunks here, else in ``Engine.forward``."""
    n, pipelined = engine.config.gradient_accumulation_steps, engine.pipeline is not None
    out = engine.guard.pull(data_iter, n, engine.global_steps + 1, check=pipelined or check)
    return [shard_batch(b, engine.mesh) for b in out] if pipelined else out


def train_batch(engine: Engine, data_iter) -> torch.Tensor:
    """``Engine.train_batch``: GAS micro-batches, one step; the mean loss over them and the dp ranks."""
    batches = pull(engine, data_iter)
    if engine.pipeline is not None:
        loss = pipeline_train_step(engine.pipeline, engine.optimizer, batches)
        engine.guard.loss = loss.detach()
        engine.report.set_step_loss(loss)
    else:
        total = torch.zeros((), dtype=torch.float32, device=engine.mesh.device)
        for batch in batches:
            loss = loss_of(engine.forward(**to_device(batch, engine.mesh.device)))
            engine.backward(loss)
            total += loss.detach().float()
        loss = total / engine.config.gradient_accumulation_steps
    engine.step()
    return engine.dp_mean(loss)


@torch.no_grad()
def eval_batch(engine: Engine, data_iter) -> torch.Tensor:
    """``Engine.eval_batch``: the mean loss over GAS micro-batches, forward only."""
    batches = pull(engine, data_iter, check=True)
    if engine.pipeline is not None:
        return engine.dp_mean(engine.pipeline.eval_batch(iter(batches)))
    device = engine.mesh.device
    loss = sum(loss_of(engine.forward(**to_device(b, device))).float() for b in batches) / len(
        batches
    )
    return engine.dp_mean(loss)
