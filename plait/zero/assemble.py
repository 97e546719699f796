"""Assembling a ``ZeroOptimizer`` from the steps of ``plait.zero.build``, in the order its constructor runs them:
the flat layout, the fp32 master and gradient shards, the torch optimizer, then the parts that run backward and
the step (the offload readiness gate, the stage-3 gatherer, the stepper, the gradient reducer).

Each function reads the options the optimizer under construction was given and returns what it holds; the
constructor (``plait.zero.optimizer``) assigns them, so every attribute is set in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from plait.parallel.sharding import ATTR as SHARD_ATTR
from plait.parallel.sharding import mark, shard_of
from plait.zero.build import (
    block_boundaries,
    check_experts,
    derive_shards,
    grad_dtypes,
    layout_entries,
    materialize,
    optimizer_groups,
    resolve_groups,
    unit_segments,
)
from plait.zero.flat import build_layout
from plait.zero.offload import (
    HostStepper,
    OffloadGatherer,
    Readiness,
    forward_order,
    host_optimizer,
    is_host_optimizer,
)
from plait.zero.pinned import host_empty
from plait.zero.stage3 import ParamGatherer
from plait.zero.stage12 import GradReducer, gives_back
from plait.zero.stepper import DeviceStepper, ShardSet, Stepper

if TYPE_CHECKING:
    from plait.zero.optimizer import ZeroOptimizer


class Layout(NamedTuple):
    """The flat groups (ZeRO Sec. 5), the stage-3 units, the trainable parameters, their device, and the
    per-group optimizer options."""

    groups: list
    units: list
    params: list[torch.nn.Parameter]
    device: torch.device
    group_opts: list[dict]


def layout_of(opt: ZeroOptimizer, param_groups, dtype: torch.dtype | None, units) -> Layout:
    """Trainable parameters of ``opt.module`` -> flat groups and stage-3 units.

    Raises:
        ValueError: no trainable parameters, bad param groups, experts the stage or offload cannot shard.
    """
    named = [(n, p) for n, p in opt.module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the module has no trainable parameters")
    for _, p in named:  # the shape must outlive ZeRO-3's release of the data (checkpoints read it)
        if getattr(p, SHARD_ATTR, None) is None:
            mark(p, shard_of(p))
    group_opts, group_of = resolve_groups(named, param_groups)
    host_ratio = opt.offload_options.ratio if opt._host else 1.0
    entries, units = layout_entries(
        opt.module,
        named,
        group_of,
        dtype,
        opt.policy,
        opt.comm.param_persistence_threshold,
        units,
        host_ratio,
        opt.comm.gather_cast,
    )
    world, rank = opt.policy.shard_world(opt.dp_size, opt.dp_rank)
    experts = opt.policy.shard_world(opt.comms.experts.size, opt.comms.experts.rank)
    groups = build_layout(entries, world, rank, opt.comm.reduce_bucket_size, experts)
    check_experts(groups, opt.stage, opt.offload_options, opt.comms)
    params = [p for _, p in named]
    return Layout(groups, units, params, params[0].device, group_opts)


class MasterShards(NamedTuple):
    """Per flat group the fp32 master shard and the gradient shard, and the dtype gradients land in."""

    masters: list[torch.Tensor]
    grad_shards: list[torch.Tensor]
    land_dtype: torch.dtype


def masters_of(opt: ZeroOptimizer, weights) -> MasterShards:
    """fp32 master shards and gradient shards, one per flat group of ``opt.groups``: on the host with offload,
    but for the groups the placement keeps on the device (``GroupKey.resident``)."""
    off = opt.offload_options
    host_params = off is not None and off.param
    on_host = [opt._host and not g.key.resident for g in opt.groups]  # offload: but resident groups
    masters = [
        materialize(
            g,
            opt.policy,
            opt.device,
            torch.device("cpu") if h else opt.device,
            host_params,
            host_params and off.pin_memory,
            weights,
        )
        for g, h in zip(opt.groups, on_host)
    ]
    if not (opt._host or host_params):  # offload: the host stepper writes the (host) shards itself
        derive_shards(opt.groups, masters)
    world = opt.policy.shard_world(opt.dp_size, opt.dp_rank)[0]  # bf16 host shards: see grad_dtypes
    grad_dtype, land_dtype = grad_dtypes(
        opt._host, opt.gradient_accumulation_steps, opt.groups, world, opt.comm.reduce_dtype
    )
    grad_shards = [
        host_empty(m.numel(), grad_dtype, off.pin_memory).zero_()
        if h
        else torch.zeros_like(m, dtype=grad_dtype)
        for h, m in zip(on_host, masters)
    ]
    return MasterShards(masters, grad_shards, land_dtype)


def optimizer_of(
    opt: ZeroOptimizer, optimizer, optimizer_kwargs: dict | None, group_opts: list[dict]
):
    """The torch optimizer (``HostOptimizer`` with offload) over ``opt.masters``; returns it and the flat
    group each of its param groups steps (``ZeroOptimizer._opt_index``)."""
    if opt._host:
        optimizer = host_optimizer(optimizer, opt.offload_options.num_threads)
    opt_groups, opt_index = optimizer_groups(group_opts, opt.groups, opt.masters)
    kwargs = dict(optimizer_kwargs or {})
    if is_host_optimizer(optimizer):  # 8-bit moments: blocks start at segments and parameter pieces
        kwargs["boundaries"] = block_boundaries(opt.groups, opt.masters)
    return optimizer(opt_groups, **kwargs), opt_index


def readiness_of(opt: ZeroOptimizer) -> Readiness | None:
    """Under optimizer offload, the gate a forward waits at per segment for the host step; None otherwise."""
    if not opt._host:
        return None
    comm = opt.comm
    order = forward_order(opt.module, [s for g in opt.groups for s in g.segments])
    return Readiness(order, opt.device, opt.comms, comm.allgather_bucket_size, comm.overlap_comm)


def gatherer_of(opt: ZeroOptimizer, ready: Readiness | None) -> ParamGatherer | None:
    """Stage 3: the gatherer of the units' parameters (``OffloadGatherer`` with parameter offload); None
    below stage 3."""
    if not opt.policy.parameters:
        return None
    comm, off = opt.comm, opt.offload_options
    unit_segments(opt.units, opt.groups)
    extra = {"device": opt.device} if off is not None and off.param else {}
    return (OffloadGatherer if extra else ParamGatherer)(
        opt.module,
        opt.units,
        opt.comms,
        comm.allgather_bucket_size,
        comm.prefetch_bucket_size,
        opt._note_backward,
        gate=ready,
        reshard_after_forward=comm.reshard_after_forward,
        cast=comm.gather_cast,
        **extra,
    )


def shard_set_of(opt: ZeroOptimizer) -> ShardSet:
    """The ``ShardSet`` the stepper and the offload parts share (the optimizer's own tensors)."""
    return ShardSet(
        tuple(opt.groups),
        tuple(opt.masters),
        tuple(opt.grad_shards),
        opt.optimizer,
        opt.clip.norm_groups,
        opt.clip.norm_exclude,
    )


def stepper_of(opt: ZeroOptimizer, ready: Readiness | None) -> Stepper:
    """The stepper over ``opt.shards``: ``HostStepper`` under optimizer offload, ``DeviceStepper`` otherwise."""
    if not opt._host:
        return DeviceStepper(
            opt.shards, opt.dp_group if opt.policy.optimizer_states else None, opt.comms, opt.comm
        )
    steps_as_is = (
        not opt.clip.max_grad_norm and opt.scaler is None and not opt.precision.skip_nonfinite
    )
    return HostStepper(
        opt.shards,
        opt.offload_options,
        ready,
        module=opt.module,
        device=opt.device,
        dp_group=opt.dp_group,
        gradient_accumulation_steps=opt.gradient_accumulation_steps,
        is_last_micro_step=opt._last_micro_step,
        steps_as_is=steps_as_is,
    )


def reducer_of(opt: ZeroOptimizer) -> GradReducer:
    """The gradient reducer into ``opt.grad_shards`` (its sink: the host stepper's ``land`` under offload)."""
    return GradReducer(
        opt.groups,
        opt.grad_shards,
        opt.comms,
        opt._land_dtype,
        opt.comm.overlap_comm,
        eager=opt.policy.gradients,
        land=opt.stepper.land if opt._host else None,
        give_back=gives_back(opt.device, opt._host, per_unit=len(opt.units) > 1),
    )
