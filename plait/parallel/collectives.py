"""Tensor-parallel collectives as autograd functions, in mirrored pairs.

Each forward collective has its adjoint as backward (Shoeybi et al., "Megatron-LM", 2019, Sec. 3 for f/g;
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, Sec. 4.2.2 for
sequence parallelism): ``copy_to_tp`` / ``reduce_from_tp`` (identity <-> all-reduce),
``scatter_to_tp`` / ``gather_from_tp`` (last dim), ``scatter_to_sp`` / ``gather_from_sp`` and
``reduce_scatter_to_sp`` (sequence dim); the table of each pair's forward and backward is in
``docs/tensor-parallel.md``.

``group=None`` (or a group of size 1) makes every function the identity, so the same layer code runs in a
single process. Activations are ``[batch, seq, ...]``; the sequence dim is 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = 1

# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.10) have only the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(
            f"dim {dim} of shape {tuple(x.shape)} ({x.shape[dim]}) is not divisible "
            f"by the tensor-parallel size ({world})"
        )
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x, group=group)
    if dim == 0:
        return out
    return torch.cat(out.chunk(world, dim=0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(
            f"dim {dim} of shape {tuple(x.shape)} ({x.shape[dim]}) is not divisible "
            f"by the tensor-parallel size ({world})"
        )
    chunks = [c.contiguous() for c in x.chunk(world, dim=dim)]
    out = torch.empty_like(chunks[0])
    reduce_scatter_flat(out, torch.cat(chunks, dim=0), group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron's *f*). Enter a tp-split region."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward (Megatron's *g*). Leave a tp-split region."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., d]`` -> this rank's ``[..., d/tp]`` chunk; backward all-gathers the last dim."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., d/tp]`` -> ``[..., d]`` by all-gather; backward keeps this rank's chunk."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, s, h]`` -> this rank's ``[b, s/tp, h]``; backward all-gathers along seq."""
    return x if group_size(group) == 1 else _ScatterToSP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, s/tp, h]`` -> ``[b, s, h]`` by all-gather; backward reduce-scatters along seq."""
    return x if group_size(group) == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, s, h]`` partial sums -> summed ``[b, s/tp, h]``; backward all-gathers along seq."""
    return x if group_size(group) == 1 else _ReduceScatterToSP.apply(x, group)
