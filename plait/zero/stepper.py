"""Steppers: the part of ``ZeroOptimizer.step`` that depends on where the fp32 master weights live.

``ZeroOptimizer.step`` owns the protocol of one step (ZeRO, SC'20, Sec. 5)::

    reduce -> norm = stepper.grad_norm() / loss_scale -> skip (stepper.discard) or
    coef = clip_coefficient(norm) / loss_scale -> stepper.apply(coef) -> finish (counters, loss scale)

``Stepper`` is the protocol; ``DeviceStepper`` (here) steps masters on the module's device and
``write_back`` publishes the weights; ``plait.zero.offload.HostStepper`` steps them on the host. Both
get a ``ShardSet`` and plain constructor arguments, and apply the coefficient they are given.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, Protocol

import torch

from plait.zero.clip import NormGroups, global_grad_norm
from plait.zero.comm import publish_segments
from plait.zero.flat import FlatGroup, Segment
from plait.zero.policy import CommOptions


@dataclass(frozen=True)
class ShardSet:
    """This rank's flat optimizer state, built once by ``ZeroOptimizer`` (after its layout, masters and
    optimizer) and handed to the stepper and the offload parts; the tensors are those ``ZeroOptimizer``
    exposes under the same names, never re-bound.

    Attributes:
        groups: the ``FlatGroup`` layouts (ZeRO Sec. 5), one per flat group.
        masters: per group the fp32 master shard ``[shard_numel]`` (host memory under offload).
        grad_shards: per group the reduced gradient shard ``[shard_numel]`` (fp32; bf16 on the host under
            offload with bf16 weights at GAS 1).
        optimizer: the torch optimizer over ``masters`` (a ``HostOptimizer`` under offload).
        norm_groups: the tp/pp groups the global gradient norm spans besides dp.
        norm_exclude: ids of parameters left out of the norm (tied copies counted on another stage).
    """

    groups: tuple[FlatGroup, ...]
    masters: tuple[torch.Tensor, ...]
    grad_shards: tuple[torch.Tensor, ...]
    optimizer: Any
    norm_groups: NormGroups = NormGroups()
    norm_exclude: frozenset[int] = frozenset()

    @property
    def segments(self) -> list[Segment]:
        """Every segment of every group, in layout order."""
        return [seg for g in self.groups for seg in g.segments]


class Stepper(Protocol):
    """What ``ZeroOptimizer.step`` needs from the side that holds the masters."""

    def grad_norm(self) -> float:
        """Global L2 norm (float64 partials) of the reduced, loss-scaled gradients over dp x tp x pp,
        each element counted once; inf/nan when any element is inf/nan. Collective."""

    def apply(self, coef: float) -> None:
        """Step the fp32 masters with ``gradient * coef`` and publish the updated compute-dtype weights
        (possibly still in flight on return: ``synchronize``)."""

    def discard(self) -> None:
        """Forget this step's gradient state (a skipped step, ``zero_grad``)."""

    def synchronize(self) -> None:
        """Finish a step still in flight after ``apply`` returned (no-op if none)."""

    def close(self) -> None:
        """Release threads and hooks."""


def folds_grad_scale(optimizer) -> bool:
    """Whether ``optimizer`` is torch's Adam or AdamW with ``fused=True`` in every group: its ``step``
    then divides each gradient by ``optimizer.grad_scale`` (a 0-dim tensor) inside the update kernel."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def write_back(groups, masters, comms, bucket_numel: int, async_op: bool) -> None:
    """Copy every fp32 master shard (``[shard_numel]`` per flat group) into the model parameters' own
    ``[S]`` slices (compute dtype) and publish them (``comm.publish_segments``). Collective over the groups
    of ``comms`` (``plait.zero.comm.Comms``)."""
    segments = []
    for group, master in zip(groups, masters):
        for seg in group.segments:
            segments.append(seg)
            if seg.source is not None:
                continue  # its shard is cast from the master at the next gather
            src = master.detach()[seg.shard_offset : seg.shard_offset + seg.shard_size]
            own = seg.local if seg.local is not None else seg.full[seg.lo : seg.lo + seg.shard_size]
            own.copy_(src)
    publish_segments(segments, comms, bucket_numel, async_op=async_op)


class DeviceStepper:
    """Steps masters that live on the module's device with the torch optimizer (``Stepper``).

    Args:
        shards: the ``ShardSet`` (fp32 ``masters`` and ``grad_shards`` on the device).
        norm_dp_group: the dp group the norm is summed over (None at stage 0: every rank holds it whole).
        comms: the groups the segments are sharded over (``plait.zero.comm.Comms``), for the write-back.
        comm: ``CommOptions`` (all-gather bucket size, ``overlap_comm``) of the write-back.
    """

    def __init__(self, shards: ShardSet, norm_dp_group, comms, comm: CommOptions):
        self.shards, self.norm_dp_group = shards, norm_dp_group
        self.comms, self.comm = comms, comm

    def grad_norm(self) -> float:
        groups = self.shards.norm_groups
        # float64 sum of float32 squares: finite for any finite gradient, inf/nan for any inf/nan element
        return float(
            global_grad_norm(self._norm_pieces(), self.norm_dp_group, groups.tp, groups.pp)
        )

    def _norm_pieces(self) -> list[tuple[torch.Tensor, bool]]:
        """``(grad view, tp_replicated)`` pieces for the global norm, leaving out parameters in
        ``norm_exclude`` (a tied copy whose twin on another pipeline stage is already counted)."""
        out, exclude = [], self.shards.norm_exclude
        for g, grp in zip(self.shards.grad_shards, self.shards.groups):
            skip = (
                sorted(
                    (pc.shard_offset, pc.shard_offset + pc.length)
                    for pc in grp.pieces()
                    if id(pc.slot.param) in exclude
                )
                if exclude
                else []
            )
            pos = 0
            for a, b in skip + [(g.numel(), g.numel())]:
                if a > pos:
                    out.append((g[pos:a], grp.key.tp_replicated))
                pos = max(pos, b)
        return out

    def apply(self, coef: float) -> None:
        shards = self.shards
        # torch's fused Adam/AdamW divide the gradient by ``grad_scale`` inside their kernel (the protocol
        # GradScaler uses): the clip coefficient rides along instead of a separate pass over every gradient
        folded = (
            coef != 1.0
            and folds_grad_scale(shards.optimizer)
            and coef > 0
            and math.isfinite(1.0 / coef)
        )
        for master, grad in zip(shards.masters, shards.grad_shards):
            if coef != 1.0 and not folded:
                grad.mul_(coef)
            master.grad = grad
        if folded:
            shards.optimizer.grad_scale = torch.full(
                (), 1.0 / coef, device=shards.masters[0].device
            )
        try:
            shards.optimizer.step()
        finally:
            if folded:
                shards.optimizer.grad_scale = None
        for master in shards.masters:
            master.grad = None
        write_back(
            shards.groups,
            shards.masters,
            self.comms,
            self.comm.allgather_bucket_size,
            self.comm.overlap_comm,
        )

    def discard(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass
