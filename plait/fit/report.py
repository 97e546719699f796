"""``plait estimate-memory MODEL``: the plan of one run printed (``plait.cli`` parses the arguments)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from plait.fit.plan import (
    ALLOCATOR_SLACK_BYTES,
    CUDA_CONTEXT_BYTES,
    Plan,
    Settings,
    auto_ratio,
    estimate,
    fixes,
    largest_fitting,
)
from plait.fit.shape import ModelShape, preset_shape, read_hf_shape

GiB = 2**30


def resolve_shape(model: str) -> ModelShape:
    """A config.json path (a file, a folder, or any name ending in .json or holding a path separator) or a
    preset name."""
    if os.path.exists(model) or model.endswith(".json") or os.sep in model:
        return read_hf_shape(model)
    return preset_shape(model)


def machine_bytes(gib: float | None, what: str) -> int:
    """``gib`` GiB in bytes, or this machine's GPU 0 / physical host memory (ValueError: none detectable)."""
    if gib is not None:
        if not 0 < gib < 2**20:
            raise ValueError(f"--{what}-gib {gib} must be a number of GiB in (0, 1048576)")
        return int(gib * GiB)
    if what == "host":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    if not torch.cuda.is_available():
        raise ValueError("no GPU on this machine: give its memory with --gpu-gib (e.g. 80 or 141)")
    return torch.cuda.get_device_properties(0).total_memory


def settings(args: argparse.Namespace, shape: ModelShape) -> tuple[Settings, bool]:
    """The run's :class:`Settings` from the flags, or from ``--ds-config`` (stage, offload, ratio, micro-batch),
    and whether the ratio is "auto" (``--ratio auto`` or the ds_config's; resolved by :func:`run_plan`)."""
    gpu, host = machine_bytes(args.gpu_gib, "gpu"), machine_bytes(args.host_gib, "host")
    if args.ds_config:
        from plait.config import load_config
        from plait.config.schema_base import AUTO
        from plait.fit.check import settings_from_config

        config = load_config(
            args.ds_config,
            dp_size=args.dp or 1,
            micro_batch_size=args.micro,
            model_hidden_size=shape.hidden_size,
            gradient_accumulation_steps=1,
            mixed_precision="bf16",
            gradient_clipping=1.0,
            lr=1e-4,
            warmup_num_steps=1,
            total_num_steps=1000,
            warmup_min_lr=0.0,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
        )
        s = settings_from_config(config, gpu, host, args.seq, args.act_ckpt, args.dp or 1)
        offload = config.zero_optimization.offload_optimizer
        return replace(s, model_build=args.model_build), offload.enabled and offload.ratio == AUTO
    auto = args.ratio == "auto"
    stage = 3 if args.stage is None else args.stage
    return Settings(
        gpu_bytes=gpu,
        host_bytes=host,
        micro_batch=args.micro,
        seq_len=args.seq,
        checkpointing=args.act_ckpt,
        stage=stage,
        dp=args.dp or 1,
        offload_optimizer=args.offload_optimizer or auto or args.ratio < 1,
        offload_param=args.offload_param,
        ratio=1.0 if auto else args.ratio,
        state_dtype=args.state_dtype,
        model_build=args.model_build,
    ), auto


def render(plan: Plan) -> str:
    """The printed plan: shape, run, placement table, peaks, verdict."""
    m, s = plan.shape, plan.settings
    offload = f"offload_optimizer ratio {s.ratio:g}" if s.offload_optimizer else "no offload"
    lines = [
        f"model: {m.name}: {m.params:,} parameters ({m.num_layers} layers, hidden {m.hidden_size}, ffn "
        f"{m.ffn_hidden_size}, {m.num_heads}/{m.num_kv_heads} heads, vocab {m.vocab_size})",
        f"run: ZeRO-{s.stage}, dp {s.dp}, {offload}{', offload_param' if s.offload_param else ''}, micro-batch "
        f"{s.micro_batch} x {s.seq_len} tokens, activation checkpointing {'on' if s.checkpointing else 'off'}",
        f"{'state':<44}{'GPU GiB':>10}{'host GiB':>10}",
    ]
    for name, gpu, host in plan.rows:
        lines.append(f"{name:<44}{gpu / GiB:>10.2f}{host / GiB:>10.2f}")
    late = (
        s.stage == 3 and not s.offload_optimizer
    )  # the fp32 gradient shard lives from backward to the step
    after = " and ".join(
        w
        for w, on in (("its working memory", plan.step), ("ZeRO-3's fp32 gradient shard", late))
        if on
    ) + (" are" if plan.step and late else " is")
    lines += [
        f"{'activations + loss (peak)':<44}{plan.activations / GiB:>10.2f}{0:>10.2f}",
        *(
            [f"{'optimizer step working memory':<44}{plan.step / GiB:>10.2f}{0:>10.2f}"]
            if plan.step
            else []
        ),
        *(f"{name:<44}{0:>10.2f}{size / GiB:>10.2f}" for name, size in plan.host_terms),
        f"{'peak':<44}{plan.gpu_peak / GiB:>10.2f}{plan.host_peak / GiB:>10.2f}",
        *(
            [
                f"(the optimizer step follows backward: {after} held after the activations peak; the peak "
                "counts the larger of the two)"
            ]
            if plan.step or late
            else []
        ),
        f"GPU need: peak + CUDA context {CUDA_CONTEXT_BYTES / GiB:.2f} + allocator reserve "
        f"{ALLOCATOR_SLACK_BYTES / GiB:.2f} = {plan.gpu_need / GiB:.2f} GiB of {s.gpu_bytes / GiB:.2f}; "
        f"host {plan.host_peak / GiB:.2f} GiB of {s.host_bytes / GiB:.2f}",
        f"fits: {'yes' if plan.fits else 'no'}",
    ]
    if not plan.fits:
        found = fixes(m, s)
        lines += [f"  would fit with: {f}" for f in found] or ["  no single change makes it fit"]
    best = largest_fitting(m, s)
    lines.append(
        f"largest of these widths that fits: {best.num_layers} layers, {best.params:,} parameters"
        if best
        else "largest of these widths that fits: none (not even one layer)"
    )
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan of ``args.model``; exit status 0, or 2 with the error on stderr for bad input."""
    from plait.config import ConfigError

    try:
        shape = resolve_shape(args.model)
        s, auto = settings(args, shape)
        if auto:  # the engine's choice (plait.fit.check.fit_config), on the GPU and run given
            ratio, why = auto_ratio(shape, s)
            print(f'offload_optimizer.ratio "auto" -> {ratio:g} ({why})')
            s = replace(s, ratio=ratio)
        print(render(estimate(shape, s)))
    except (ValueError, OSError, ConfigError) as err:
        print(f"plait estimate-memory: {err}", file=sys.stderr)
        return 2
    return 0
