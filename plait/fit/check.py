"""The engine's refusal of a run that clearly cannot fit, before anything is allocated on the device.

``plait.initialize`` calls :func:`fit_config` before it moves the model to its device. For a Llama-style model
(a Hugging Face ``config`` with a dense Llama ``model_type``, or a plait Llama) it plans the run
(``plait.fit.plan``) from the ds_config (ZeRO stage, offload, ratio, micro-batch) and refuses it when the
planned bytes exceed the memory by more than ``memory_check.margin`` (default 10%; on the host, the planned
states without the process overhead), naming the bytes on each
side and the single changes that would make it fit. The sequence length is ``memory_check.seq_len`` (None:
activations are left out, so only model states can refuse a run). Off with ``memory_check.enabled: false`` or
the environment variable ``PLAIT_MEMORY_CHECK=0``. The memory is the device's total memory and the host's
physical memory, or ``memory_check.gpu_bytes`` / ``host_bytes`` where given (a simulated GPU in tests).
``offload_optimizer.ratio: "auto"`` is resolved here too, from the same plan and the GPU's free memory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from plait.config import ConfigError, PlaitConfig
from plait.config.schema_base import AUTO
from plait.fit.plan import Plan, Settings, auto_ratio, estimate, fixes, unplanned
from plait.fit.shape import ModelShape, shape_from_hf

GiB = 2**30
log = logging.getLogger("plait")


def settings_from_config(
    config: PlaitConfig,
    gpu_bytes: int,
    host_bytes: int,
    seq_len: int,
    checkpointing: bool,
    dp: int = 1,
) -> Settings:
    """:class:`Settings` of a resolved ds_config (stage, offload, ratio, micro-batch, accumulation, bucket; a
    bucket still "auto" is plait's default)."""
    z = config.zero_optimization
    fraction = z.offload_optimizer.device_step_fraction
    bucket = (
        z.reduce_bucket_size
        if isinstance(z.reduce_bucket_size, int) and z.reduce_bucket_size > 0
        else Settings.bucket_numel
    )
    return Settings(
        gpu_bytes=gpu_bytes,
        host_bytes=host_bytes,
        micro_batch=config.train_micro_batch_size_per_gpu,
        seq_len=seq_len,
        checkpointing=checkpointing,
        stage=z.stage,
        dp=dp,
        offload_optimizer=z.offload_optimizer.enabled,
        offload_param=z.offload_param.enabled,
        ratio=z.offload_optimizer.ratio
        if z.offload_optimizer.enabled and z.offload_optimizer.ratio != AUTO
        else 1.0,  # "auto": fit_config plans each ratio
        gradient_accumulation=config.gradient_accumulation_steps,
        state_dtype=config.optimizer_state_dtype,
        device_share=fraction not in (0, 0.0)
        and (fraction is not None or z.offload_optimizer.pin_memory),
        bucket_numel=bucket,
    )


def model_shape(model) -> ModelShape | None:
    """The shape of a Hugging Face Llama-style model (its ``config``) or a plait Llama; None for others."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict") and getattr(config, "model_type", None):
        try:
            return shape_from_hf(config.to_dict(), f"{type(model).__name__}.config")
        except ValueError:
            return None
    if getattr(config, "arch", None) == "llama" and not getattr(config, "num_experts", 0):
        return ModelShape(
            type(model).__name__,
            config.vocab_size,
            config.hidden_size,
            config.num_layers,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim or config.hidden_size // config.num_heads,
            config.ffn_hidden_size,
            config.tie_embeddings,
        )
    return None


def refusal(plan: Plan, margin: float) -> str | None:
    """The refusal message when ``plan`` exceeds the GPU or the host by more than ``margin``; else None."""
    s = plan.settings
    over_gpu = plan.gpu_need > (1 + margin) * s.gpu_bytes
    # the host side counts the planned states only, not the process and build terms of plait.fit.host: not every
    # recorded host peak is explained within 10% (benchmarks/results/estimate_memory.md), and a run that fits
    # must never be refused
    over_host = plan.host_states > (1 + margin) * s.host_bytes
    if not (over_gpu or over_host):
        return None
    seq = (
        f"micro-batch {s.micro_batch} x {s.seq_len} tokens"
        if s.seq_len > 1
        else f"micro-batch {s.micro_batch}, activations not counted (set memory_check.seq_len)"
    )
    where = " and ".join(w for w, o in (("GPU", over_gpu), ("host", over_host)) if o)
    found = fixes(plan.shape, s)
    fix = (
        ("; it would fit with any one of: " + "; ".join(found))
        if found
        else "; no single change of offload ratio, offload_param, micro-batch or checkpointing makes it fit"
    )
    return (
        f"{plan.shape.name} ({plan.shape.params:,} parameters) does not fit the {where}: it needs "
        f"{plan.gpu_need / GiB:.1f} GiB on the GPU (of {s.gpu_bytes / GiB:.1f} GiB) and "
        f"{plan.host_peak / GiB:.1f} GiB on the host (of {s.host_bytes / GiB:.1f} GiB) with ZeRO-{s.stage}, "
        f"offload_optimizer {'ratio ' + format(s.ratio, 'g') if s.offload_optimizer else 'off'}, "
        f"offload_param {'on' if s.offload_param else 'off'}, {seq}, activation checkpointing "
        f"{'on' if s.checkpointing else 'off'}{fix}. Refused before allocating (plait.fit); "
        "memory_check.enabled false or PLAIT_MEMORY_CHECK=0 turns the check off"
    )


def fit_config(model, config: PlaitConfig, device: torch.device, dp: int = 1) -> PlaitConfig:
    """``config`` with ``offload_optimizer.ratio: "auto"`` resolved (the smallest host share, in steps of 0.05,
    whose planned GPU need fits the GPU: ``memory_check.gpu_bytes``, else the device's free memory plus what
    this process holds, measured now), after refusing (ConfigError) a run of ``model`` that clearly does not
    fit (module docstring). The check returns silently when it is off or ``model`` or the placement is not
    one it plans (``plan.unplanned``); a "auto" ratio it cannot plan becomes 1 (every state on the host,
    DeepSpeed's default), with a warning saying why. The sequence length planned is ``memory_check.seq_len``; "auto" without it plans the model's
    ``max_position_embeddings`` (the longest sample)."""
    c, z = config.memory_check, config.zero_optimization
    auto = z.offload_optimizer.enabled and z.offload_optimizer.ratio == AUTO
    shape = model_shape(model)
    gpu = c.gpu_bytes or (_available(device) if device.type == "cuda" else None)
    off = not c.enabled or os.environ.get("PLAIT_MEMORY_CHECK", "1") == "0"
    if auto:
        ratio, why = _auto_ratio(model, shape, config, gpu, dp)
        log.warning('config: offload_optimizer.ratio "auto" -> %g (%s)', ratio, why)
        config = replace(
            config,
            zero_optimization=replace(
                z, offload_optimizer=replace(z.offload_optimizer, ratio=ratio)
            ),
        )
    if off or shape is None or gpu is None:
        return config
    settings = settings_from_config(
        config, gpu, _host_bytes(c), c.seq_len or 1, _checkpointing(model), dp
    )
    if unplanned(settings):  # a placement the engine runs and the plan does not model: no check
        return config
    plan = estimate(shape, settings)
    if c.seq_len is None:
        plan = replace(plan, gpu_peak=plan.gpu_peak - plan.activations, activations=0)
    message = refusal(plan, c.margin)
    if message:
        raise ConfigError(message)
    return config


def _auto_ratio(
    model, shape: ModelShape | None, config: PlaitConfig, gpu: int | None, dp: int
) -> tuple[float, str]:
    """(the "auto" host share, the reason, for the log)."""
    z, opt = config.zero_optimization, config.optimizer
    kept = (
        "offload_param"
        if z.offload_param.enabled
        else "pipeline parallelism"
        if config.pipeline.size > 1
        else f"the {opt.type} optimizer"
        if opt is not None and opt.type.lower() not in ("adam", "adamw")
        else None
    )
    if kept:
        return 1.0, (
            f"{kept} keeps every optimizer state on the host (GPU-first placement: Adam/AdamW, weights on "
            "the GPU)"
        )
    if shape is None:
        return 1.0, f"{type(model).__name__} is not a Llama-style model plait.fit plans"
    if gpu is None:
        return 1.0, "no GPU to plan for (memory_check.gpu_bytes sets one)"
    seq = (
        config.memory_check.seq_len
        or getattr(getattr(model, "config", None), "max_position_embeddings", None)
        or 1
    )
    return auto_ratio(
        shape,
        settings_from_config(
            config, gpu, _host_bytes(config.memory_check), seq, _checkpointing(model), dp
        ),
    )


def _available(device: torch.device) -> int:
    """Bytes this process can have on ``device``: free now, plus what its caching allocator holds."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def _host_bytes(c) -> int:
    return c.host_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _checkpointing(model) -> bool:
    name = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )  # transformers 5 renamed it
    return bool(getattr(model, name, False))
