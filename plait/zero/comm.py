"""Collectives over flat segments (ZeRO, Sec. 5): coalesced parameter all-gathers, gradient
reduce-scatters, and ``publish_segments``, which hands updated parameter shards to every dp rank.

Every function here is collective over the process group it is given: all ranks call it with
segments of the same sizes in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from plait.parallel.collectives import all_gather_flat, group_rank, group_size, reduce_scatter_flat
from plait.zero.flat import Segment


@dataclass(frozen=True)
class ShardComm:
    """The ranks a flat group's segments are sharded and reduced over.

    Attributes:
        group: the process group (None: one process). size: its ranks.
        divisor: what a gradient summed over ``group`` is divided by: the data-parallel size, ``size`` for
            ordinary weights; for expert weights under expert parallelism (``group`` the expert-data-parallel
            ranks, ``size = dp / ep``) still ``dp``, as each rank's gradient already sums the contributions
            of its ep group's tokens (their mean over all dp ranks is the single-process gradient).
    """

    group: object
    size: int
    rank: int
    divisor: int

    def source(self, dp_rank: int, dp_size: int) -> int:
        """The rank of this group that holds what dp rank ``dp_rank`` holds (dp ranks are ``edp x ep`` with
        ep fastest, ``plait.parallel.mesh``)."""
        return dp_rank * self.size // dp_size


class Comms(NamedTuple):
    """Where flat groups live: ``dp`` for every weight, ``experts`` for expert weights split over ep ranks
    (``GroupKey.experts``)."""

    dp: ShardComm
    experts: ShardComm

    def of(self, seg: Segment) -> ShardComm:
        return self.experts if seg.key.experts else self.dp

    def split(self, segments) -> list[tuple[ShardComm, list]]:
        """``segments`` by their comm (dp first), order kept within each: collectives run per comm."""
        parts = [
            (c, [s for s in segments if self.of(s) == c])
            for c in dict.fromkeys((self.dp, self.experts))
        ]
        return [(c, segs) for c, segs in parts if segs]


def make_comms(dp_group, expert_group=None) -> Comms:
    """A ZeRO optimizer's ``Comms``: every weight over ``dp_group``; expert weights over ``expert_group`` (the
    expert-data-parallel ranks, ``ParallelMesh.group("edp")``; default ``dp_group``), divided by the dp size."""
    dp = group_size(dp_group)
    experts = dp_group if expert_group is None else expert_group
    return Comms(
        ShardComm(dp_group, dp, group_rank(dp_group), dp),
        ShardComm(experts, group_size(experts), group_rank(experts), dp),
    )


class Pending:
    """Handle on launched collectives: ``wait()`` waits for them, then runs the finishers (copies
    out of staging buffers) once. Collectives launched synchronously are already done."""

    def __init__(self, works=(), finish: Callable[[], None] | None = None, keep=()):
        self.works = [w for w in works if w is not None]
        self.finish = finish
        self.keep = list(keep)  # tensors an async collective reads or writes: alive until wait()
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for w in self.works:
            w.wait()
        if self.finish is not None:
            self.finish()
        self.keep.clear()
        self.done = True


def gather_segments(
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    group,
    world: int,
    bucket_numel: int,
    async_op: bool = False,
) -> list[tuple[Pending, list[int]]]:
    """All-gather ``inputs[k]`` (``[S_k]``, this rank's slice) into ``outputs[k]`` (``[world*S_k]``).

    Consecutive segments of one dtype are coalesced into one collective while their total padded size
    stays within ``bucket_numel`` elements (a staging buffer is then copied out on ``wait``).
    ``world == 1`` copies locally. Collective over ``group``: every rank must call it with segments
    of the same sizes in the same order. Returns ``(pending, indices of the segments it covers)``
    per collective; with ``async_op=False`` they are already complete.
    """
    if world == 1:
        for out, inp in zip(outputs, inputs):
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
        return []
    runs: list[list[int]] = []
    total = 0
    for k, out in enumerate(outputs):
        if runs and total + out.numel() <= bucket_numel and out.dtype == outputs[runs[-1][0]].dtype:
            runs[-1].append(k)
            total += out.numel()
        else:
            runs.append([k])
            total = out.numel()
    pendings = []
    for run in runs:
        if len(run) == 1:
            k = run[0]
            src = inputs[k].contiguous()
            work = all_gather_flat(outputs[k], src, group=group, async_op=async_op)
            pendings.append((Pending([work] if async_op else [], keep=[src]), run))
            continue
        sizes = [inputs[k].numel() for k in run]
        staged = torch.cat([inputs[k].reshape(-1) for k in run])
        buf = torch.empty(world * staged.numel(), dtype=staged.dtype, device=staged.device)
        work = all_gather_flat(buf, staged, group=group, async_op=async_op)

        def finish(run=run, sizes=sizes, buf=buf):
            per_rank = buf.view(world, -1)
            col = 0
            for k, s in zip(run, sizes):
                outputs[k].view(world, s).copy_(per_rank[:, col : col + s])
                col += s

        p = Pending([work] if async_op else [], finish, keep=[staged])
        if not async_op:
            p.wait()
        pendings.append((p, run))
    return pendings


def reduce_segment_grads(
    seg: Segment,
    group,
    world: int,
    reduce_dtype: torch.dtype,
    release: bool,
    async_op: bool,
    out: torch.Tensor | None = None,
    divisor: int | None = None,
) -> tuple[Pending, torch.Tensor]:
    """Sum the gradients of ``seg``'s parameters over the ``world`` ranks of ``group``, divided by ``divisor``
    (the dp ranks' mean; ``ShardComm``).

    Packs each ``param.grad`` (missing: zero) into a ``[padded]`` buffer of ``reduce_dtype``,
    divides by ``divisor`` (default ``world``; ``ShardComm.divisor``) before the sum, so fp16/bf16
    reductions do not overflow, and
    reduce-scatters it when the segment is sharded (``seg.world > 1``; the result is this rank's
    ``[S]`` slice) or all-reduces it (stage 0; the result is ``[padded]``). ``release`` sets each
    ``param.grad`` to None once packed (stages 1-3 keep no full gradients). Returns the pending
    collective and the tensor that holds the result after ``wait()``. ``out`` (a grad-shard slice of
    ``reduce_dtype``, or None) receives the result in place: with ``world == 1`` the gradients are packed
    straight into it (``[padded]``), else the reduce-scatter writes it (``[S]``; not for stage 0).
    """
    buf = seg.pack(
        lambda s: s.param.grad, reduce_dtype, out=out if world == 1 else None, batched=True
    )
    if release:
        for slot in seg.slots:
            slot.param.grad = None
    divisor = world if divisor is None else divisor
    if divisor > 1:
        buf.div_(divisor)
    if world == 1:
        return Pending(), buf if seg.world == 1 else buf[seg.lo : seg.lo + seg.shard_size]
    if seg.world == 1:
        work = dist.all_reduce(buf, group=group, async_op=async_op)
        return Pending([work] if async_op else [], keep=[buf]), buf
    out = (
        out
        if out is not None
        else torch.empty(seg.shard_size, dtype=reduce_dtype, device=buf.device)
    )
    work = reduce_scatter_flat(out, buf, group=group, async_op=async_op)
    return Pending([work] if async_op else [], keep=[buf]), out


def publish_segments(segments, comms: Comms, bucket_numel: int, async_op: bool = False) -> None:
    """Make the updated shards of ``segments`` visible wherever the parameters are read whole.

    The caller has already written each segment's own ``[S]`` slice (``seg.local`` for stage-3 shards, or
    their fp32 master slice when ``seg.shard()`` derives them; ``seg.full[lo:lo+S]`` otherwise). Stage-3
    shards are copied into their gathered ``[padded]`` buffer only while gathered (``gathered_parameters()``);
    segments whole on every rank (stages 1-2, stage-3 persistent; ``seg.world > 1``) are all-gathered over
    their group (``comms``; ZeRO Sec. 5.1: the parameter all-gather after the update). Waits for every
    collective. Collective over the groups of ``comms``.
    """
    made = []
    for comm, segs in comms.split(segments):
        outs, ins = [], []
        for seg in segs:
            if seg.local is not None:
                if seg.full is not None:
                    outs.append(seg.full)
                    ins.append(seg.shard().to(seg.full.device))
                    made += (
                        [seg] if seg.full is not seg.local else []
                    )  # one rank: the shard is the buffer
            elif seg.world > 1:
                outs.append(seg.full)
                ins.append(seg.full[seg.lo : seg.lo + seg.shard_size].clone())
        for pending, _ in gather_segments(
            outs, ins, comm.group, comm.size, bucket_numel, async_op=async_op
        ):
            pending.wait()
    for seg in made:
        seg.drop_shard()
