"""ZeRO-Offload options from a ds_config, with the combinations the engine refuses, and the optimizer the
engine builds (which depends on them)."""

from __future__ import annotations

import functools
import os

from plait.config import ConfigError, PlaitConfig
from plait.optim.factory import NoOptimizer, optimizer_from_config, optimizer_from_user
from plait.optim.lamb import Lamb
from plait.zero.offload import HostOptimizer, OffloadOptions


def engine_optimizer(
    config: PlaitConfig, optimizer, offload: OffloadOptions | None, device_type: str
):
    """``(factory, kwargs, param groups or None)`` of the engine's optimizer: the user's (``optimizer``), else the
    config's (Lion offloaded: the host kernel), else none at all (``NoOptimizer``: forward only, as DeepSpeed
    builds an engine without an optimizer).

    ``optimizer.params.state_dtype`` bf16/int8 (Adam moments in less than fp32): the ``HostOptimizer`` kernels,
    offloaded or not (on the device its torch ops, ``plait.zero.offload.device_states``).

    Raises:
        ConfigError: ``offload_optimizer`` without any optimizer; an optimizer type plait cannot build; a
            ``state_dtype`` other than fp32 with an optimizer passed to initialize.
    """
    state_dtype = config.optimizer_state_dtype
    if optimizer is not None:
        if state_dtype != "fp32":
            raise ConfigError(
                f"optimizer.params.state_dtype = {state_dtype!r} applies to the config's Adam/AdamW, but an "
                "optimizer was passed to initialize; remove optimizer= or remove state_dtype"
            )
        return optimizer_from_user(optimizer)
    if config.optimizer is None:
        if config.zero_optimization.offload_optimizer.enabled:
            raise ConfigError(
                "zero_optimization.offload_optimizer is set but there is no optimizer (no "
                "'optimizer' section, none passed); remove offload_optimizer or add an optimizer"
            )
        return NoOptimizer, {}, None
    if offload and offload.optimizer and config.optimizer.type == "Lion":
        params = dict(config.optimizer.params)
        return (
            functools.partial(HostOptimizer, kind="lion"),
            {**params, "betas": tuple(params["betas"])},
            None,
        )
    if state_dtype != "fp32":
        params = dict(config.optimizer.params)
        params.pop("state_dtype", None)
        adamw = params.pop("adam_w_mode", True) or config.optimizer.type == "AdamW"
        kind = "adamw" if adamw else "adam"
        return (
            functools.partial(HostOptimizer, kind=kind, state_dtype=state_dtype),
            {**params, "betas": tuple(params.get("betas", (0.9, 0.999)))},
            None,
        )
    return (*optimizer_from_config(config.optimizer, device_type), None)


def offload_options(config: PlaitConfig, pipeline, optimizer) -> OffloadOptions | None:
    """``OffloadOptions`` from ``zero_optimization.offload_optimizer`` / ``offload_param`` (None when both
    are off). ``pin_memory`` of either section pins the host buffers; the CPU optimizer's thread count
    comes from the environment variable ``PLAIT_OFFLOAD_THREADS`` (default: every core numba sees).
    ``device_step_fraction`` (a number, "auto": the adaptive split, or None: "auto" where it applies) is passed
    on as read; the deprecated
    ``device_step_adaptive`` was folded into it by the config (``plait.config.schema_zero.OffloadConfig``).

    Raises:
        ConfigError: a device share with a pipeline (``check_pipeline_offload``), LAMB with offload_optimizer, a
            bad PLAIT_OFFLOAD_THREADS.
    """
    z = config.zero_optimization
    if not (z.offload_optimizer.enabled or z.offload_param.enabled):
        return None
    if pipeline is not None:
        check_pipeline_offload(z)
    kind = (
        config.optimizer.type.lower()
        if optimizer is None and config.optimizer is not None
        else None
    )
    if z.offload_optimizer.enabled and (
        kind == "lamb" or isinstance(optimizer, Lamb) or optimizer is Lamb
    ):
        raise ConfigError(
            "LAMB cannot run offloaded: its per-tensor trust ratio needs norms summed over the dp "
            "ranks sharing a tensor, which the CPU kernels do not do; use Adam/AdamW/Lion with "
            "offload_optimizer, or LAMB without it"
        )
    threads = os.environ.get("PLAIT_OFFLOAD_THREADS")
    if threads is not None and not threads.isdigit():
        raise ConfigError(
            f"PLAIT_OFFLOAD_THREADS={threads!r} must be a positive integer (CPU optimizer threads)"
        )
    return OffloadOptions(
        optimizer=z.offload_optimizer.enabled,
        param=z.offload_param.enabled,
        pin_memory=z.offload_optimizer.pin_memory or z.offload_param.pin_memory,
        num_threads=int(threads) if threads else None,
        device_step_fraction=z.offload_optimizer.device_step_fraction,
        ratio=z.offload_optimizer.ratio,
        final_at_step=pipeline is not None,
    )


def check_pipeline_offload(z) -> None:
    """The offload settings a pipeline engine refuses (``z``: the config's ``zero_optimization``).

    With a pipeline the engine sums the tied embedding copies' gradients after the schedule, in the host
    gradient shards (``plait.engine.pipeline``), so the offload takes every gradient as final only at
    ``step()`` (``OffloadOptions.final_at_step``). A device share of the host step keeps its gradients on the
    device, out of reach of that sum.

    Raises:
        ConfigError: ``offload_optimizer.device_step_fraction`` "auto" or above 0 (the value and the fix named).
    """
    fraction = z.offload_optimizer.device_step_fraction
    if z.offload_optimizer.enabled and fraction not in (None, 0, 0.0):
        raise ConfigError(
            f"offload_optimizer.device_step_fraction = {fraction!r} with pipeline parallelism: a "
            "pipeline edits the gradients after its schedule (the tied embedding sum), in host memory, "
            "which the device share's gradients (kept on the device) would miss; set it to 0 or leave "
            "it out"
        )
