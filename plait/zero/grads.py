"""Whole gradients of chosen parameters, whatever the ZeRO stage: for code that must combine the
gradients of several parameters after backward (a pipeline summing the tied embedding and its head
copy on two stages) without knowing where the stage keeps them; and the weak gradient hook."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from plait.parallel.sharding import shard_of


@contextmanager
@torch.no_grad()
def whole_gradients(zero, params: list[torch.nn.Parameter]) -> Iterator[list[torch.Tensor]]:
    """Yield one gradient tensor per parameter of ``params``, to be edited in place; the edits are kept.

    * Stages 0-1 keep gradients in ``.grad`` (reduced over dp at the step): those are yielded (the
      parameter's dtype and this rank's tensor-parallel shape; zeros where None), not yet reduced.
    * Stages 2-3 reduce-scattered them during backward into the fp32 gradient shards: the whole
      dp-reduced gradient of each is rebuilt from the dp ranks' pieces (float32, flat ``[numel]`` of this
      rank's tensor-parallel shard; one dp all-reduce per parameter) and this rank's pieces are written
      back on exit.

    An elementwise combination of the yielded tensors (a sum of two copies) is linear, so it equals the
    same combination before the dp reduction. Collective over the dp group at stages 2-3. Raises nothing
    of its own (a parameter ``zero`` does not hold simply has no pieces: zeros are yielded for it).

    Args:
        zero: the ``ZeroOptimizer`` that owns ``params``.
        params: parameters of ``zero``'s module.
    """
    if not zero.policy.gradients:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        yield [p.grad for p in params]
        return
    zero.reducer.wait()
    fulls, where = [], []
    if any(shard_of(p).axis == "ep" and shard_of(p).world > 1 for p in params):
        raise ValueError(
            "whole_gradients sums over the dp ranks, which hold other experts' weights under expert "
            "parallelism: pass no expert weights"
        )
    for param in params:
        full = torch.zeros(
            math.prod(shard_of(param).local_shape),
            dtype=torch.float32,  # numel is 0 at stage 3
            device=zero.device,
        )
        pieces = [
            (pc, gi)
            for gi, g in enumerate(zero.groups)
            for pc in g.pieces()
            if pc.slot.param is param
        ]
        for pc, gi in pieces:
            full[pc.start : pc.start + pc.length] = zero.grad_shards[gi][
                pc.shard_offset : pc.shard_offset + pc.length
            ]
        if zero.dp_size > 1:
            dist.all_reduce(full, group=zero.dp_group)
        fulls.append(full)
        where.append(pieces)
    yield fulls
    for full, pieces in zip(fulls, where):
        for pc, gi in pieces:
            zero.grad_shards[gi][pc.shard_offset : pc.shard_offset + pc.length] = full[
                pc.start : pc.start + pc.length
            ]


def weak_hook(method):
    """A gradient hook calling the bound ``method`` while its object lives (a no-op after), holding it weakly:
    hooks live in C++ autograd nodes that hold the parameters out of the garbage collector's sight, so a bound
    method there would keep its object (a ``ZeroOptimizer`` and its offload thread) alive for good."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return call
