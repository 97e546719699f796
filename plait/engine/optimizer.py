"""The engine's optimizer and schedule: ZeRO over the model's parameter groups, in the config's precision,
with its communication, clipping and offload options (``ZeroOptimizer``), and the learning-rate schedule
over the inner optimizer."""

from __future__ import annotations

import torch
from torch import nn

from plait.config import PlaitConfig
from plait.engine.model import as_groups, stage3_units
from plait.engine.offload import engine_optimizer, offload_options
from plait.layers.init import TIED_ATTR
from plait.optim.factory import scheduler_from_config, scheduler_from_user
from plait.optim.lamb import Lamb
from plait.optim.lamb_segments import attach_lamb_segments
from plait.parallel.mesh import ParallelMesh
from plait.zero import (
    ClipOptions,
    CommOptions,
    LossScaler,
    NormGroups,
    PrecisionOptions,
    ZeroOptimizer,
    weight_decay_groups,
)


def zero_optimizer(
    module: nn.Module,
    config: PlaitConfig,
    mesh: ParallelMesh,
    optimizer,
    model_parameters,
    pipeline=None,
    weights=None,
    units=None,
) -> ZeroOptimizer:
    """The ``ZeroOptimizer`` of ``plait.initialize``'s arguments (see its docstring) over ``module``'s
    parameters, sharded over the mesh's dp x cp ranks (expert weights over its expert-data-parallel ranks)."""
    z = config.zero_optimization
    offload = offload_options(config, pipeline, optimizer)
    precision = precision_options(config)
    factory, kwargs, groups = engine_optimizer(config, optimizer, offload, mesh.device.type)
    if groups is None and model_parameters is not None:
        groups = as_groups(model_parameters)
    if groups is None:
        groups = weight_decay_groups(module, kwargs.get("weight_decay", 0.0))
        groups = [g for g in groups if g["params"]]
    zero = ZeroOptimizer(
        module,
        mesh.group("dp_cp"),
        expert_group=mesh.group("edp") if mesh.ep > 1 else None,
        stage=z.stage,
        optimizer=factory,
        optimizer_kwargs=kwargs,
        param_groups=groups,
        comm=comm_options(config, module),
        units=(units if units is not None else stage3_units(module)) if z.stage == 3 else None,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        offload=offload,
        weights=weights,
        precision=precision,
        clip=ClipOptions(
            config.gradient_clipping,
            NormGroups(tp=mesh.tp_group, pp=mesh.pp_group),
            # a tied head copy (on another pipeline stage than its embedding) counts once
            norm_exclude={id(p) for p in module.parameters() if getattr(p, TIED_ATTR, None)},
        ),
    )
    if isinstance(zero.optimizer, Lamb):
        attach_lamb_segments(zero.optimizer, zero, module, mesh)
    return zero


def precision_options(config: PlaitConfig) -> PrecisionOptions:
    """fp16 (with the config's loss scaler), bf16, or the parameters' own dtype; the non-finite guard."""
    if config.fp16.enabled:
        f = config.fp16
        scaler = LossScaler(
            f.loss_scale,
            f.initial_scale_power,
            f.loss_scale_window,
            f.hysteresis,
            f.min_loss_scale,
            f.consecutive_hysteresis,
        )
        return PrecisionOptions(
            torch.float16, scaler, skip_nonfinite=config.nonfinite_guard.enabled
        )
    param_dtype = torch.bfloat16 if config.bf16.enabled else None
    return PrecisionOptions(param_dtype, None, skip_nonfinite=config.nonfinite_guard.enabled)


def comm_options(config: PlaitConfig, module: nn.Module | None = None) -> CommOptions:
    """The ``zero_optimization`` section's buckets, overlap and stage-3 options, ``communication_data_type``,
    and ``fp8.float8_all_gather`` over ``module``'s float8 layers (``plait.precision.float8_gather``)."""
    gather_cast = None
    if config.fp8.float8_all_gather:  # imports torchao
        from plait.precision.float8_gather import Float8Gather

        gather_cast = Float8Gather(module)
    z = config.zero_optimization
    reduce_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
        config.communication_data_type, torch.float32
    )
    return CommOptions(
        reduce_dtype=reduce_dtype,
        # a bucket size of 0 (the Hugging Face test configs): every gradient is reduced on its own, as DeepSpeed
        reduce_bucket_size=max(1, z.reduce_bucket_size),
        allgather_bucket_size=max(1, z.allgather_bucket_size),
        overlap_comm=z.overlap_comm,
        prefetch_bucket_size=z.stage3_prefetch_bucket_size,
        param_persistence_threshold=z.stage3_param_persistence_threshold,
        reshard_after_forward=z.reshard_after_forward,
        gather_cast=gather_cast,
    )


def lr_schedule(config: PlaitConfig, lr_scheduler, inner):
    """The schedule over ``inner`` (the optimizer ZeRO steps): the user's factory ``f(inner)``, else the
    config's ``scheduler`` section (None when it has none)."""
    if lr_scheduler is not None:
        return scheduler_from_user(lr_scheduler, inner)
    return scheduler_from_config(config.scheduler, inner)
