"""Global gradient norm over dp, tp and pp, and clipping by it (Pascanu et al., ICML 2013, Sec. 3.2:
rescale ``g`` to ``max_norm * g / ||g||`` when ``||g|| > max_norm``).

``global_grad_norm`` gives the single-process model's norm however the gradient is spread: squares summed
over dp (ZeRO shards; ``dp_group=None`` for stage-0 whole gradients) and pp; a tp-split parameter
counts every shard, a tp-replicated one only on tp rank 0. A parameter duplicated on several pipeline
stages (tied embeddings) must be passed by one stage only. ``sum_squares64`` (float64 partial sums) and
``clip_coefficient`` are the pieces the steppers use. Details: ``docs/zero.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.kernels import gpu_norm
from plait.parallel.collectives import group_rank, group_size


@dataclass(frozen=True)
class NormGroups:
    """The model-parallel groups a gradient norm (and the fp16 overflow flag) must span.

    ``tp``: ``mesh.tp_group``; ``pp``: ``mesh.pp_group``. None (the default) for a dim of size 1.
    """

    tp: object = None
    pp: object = None


def global_grad_norm(
    pieces: Iterable[tuple[torch.Tensor, bool]],
    dp_group=None,
    tp_group=None,
    pp_group=None,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model's gradient, identical on every rank.

    Args:
        pieces: ``(grad, tp_replicated)`` pairs: gradient tensors (any shape) this rank accounts
            for, disjoint from other dp ranks' pieces when ``dp_group`` is given; ``tp_replicated``
            marks a gradient that every tp rank also holds (counted on tp rank 0 only).
        dp_group, tp_group, pp_group: groups to reduce over (None: not split along that dim).
        norm_type: 2.0 (default), any p >= 1, or ``math.inf``.

    Returns:
        0-dim float64 tensor (on the pieces' device), the same value on all ranks. The 2-norm sums
        the float32 squares (each exact in float64) in float64 by ``sum_squares64``, as the offloaded
        step does (``plait.zero.offload``): any two summation orders then agree to ~1e-16 relative,
        so both paths derive the same float32 clip coefficient (``clip_coefficient``) wherever the
        pieces are cut and whatever vector width the CPU kernels use.

    Collective: all-reduce (SUM, or MAX for inf) over each non-None group of size > 1.

    Raises:
        ValueError: ``norm_type`` < 1.
    """
    if norm_type < 1:
        raise ValueError(f"norm_type must be >= 1 or inf, got {norm_type}")
    pieces = list(pieces)
    device = pieces[0][0].device if pieces else torch.device("cpu")
    skip_replicated = group_rank(tp_group) != 0
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad, replicated in pieces:
        if grad.numel() == 0 or (replicated and skip_replicated):
            continue
        g = grad.detach().reshape(-1)
        if norm_type == math.inf:
            total = torch.maximum(total, g.abs().max().double())
        elif norm_type == 2.0:
            total = total + sum_squares64(g)
        else:
            total = total + torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) ** norm_type
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    total = total.reshape(1)
    for group in (dp_group, tp_group, pp_group):
        if group is not None and group_size(group) > 1:
            dist.all_reduce(total, op=op, group=group)
    total = total.reshape(())
    return total if norm_type == math.inf else total.pow(1.0 / norm_type)


def sum_squares64(x: torch.Tensor, excluded=(), chunk: int = 1 << 23) -> torch.Tensor:
    """``sum(x**2)`` over ``x`` (``[n]``, any float dtype) minus the ``excluded`` ``(start, end)`` ranges, as a
    float64 scalar on ``x``'s device. Every square is exact and the sum is float64, so any two summation
    orders agree to ~1e-16 relative. On a GPU one read of ``x`` (``plait.kernels.gpu_norm``, Triton);
    elsewhere at most ``chunk`` elements at a time are widened to float64 (8 bytes each)."""

    def part(t: torch.Tensor) -> torch.Tensor:
        if gpu_norm.available(t):  # one read of t, widened in registers (plait.kernels.gpu_norm)
            return gpu_norm.gpu_sum_squares64(t)
        total = torch.zeros((), dtype=torch.float64, device=t.device)
        for a in range(0, t.numel(), chunk):
            w = t[a : a + chunk].to(torch.float64)
            total += torch.dot(w, w)
        return total

    total = part(x)
    for a, b in excluded:
        total = total - part(x[a:b])
    return total


def clip_coefficient(total_norm: float, max_norm: float | None, eps: float = 1e-6) -> float:
    """Factor to multiply gradients by: ``min(1, max_norm / (total_norm + eps))`` — the formula of
    ``torch.nn.utils.clip_grad_norm_``; 1.0 when clipping is off (``max_norm`` 0 or None)."""
    if not max_norm or max_norm <= 0:
        return 1.0
    return min(1.0, float(max_norm) / (float(total_norm) + eps))
