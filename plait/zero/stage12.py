"""Gradient reduction for ZeRO stages 0-3 (ZeRO, Sec. 5.1-5.2): ``GradReducer`` moves ``param.grad``
into each rank's float32 grad shard per flat group (``[shard_numel]``; gradient-accumulation
micro-steps add there in fp32).

Stage 0 all-reduces each segment; stages 1-3 reduce-scatter it to its owner. ``eager=False`` (stages
0-1): ``reduce_all()`` at the accumulation boundary. ``eager=True`` (stages 2-3): ``on_grad(param)`` from
each parameter's post-accumulate-grad hook reduces a segment once all its gradients are in, ``flush()``
at the end of backward reduces the rest; with ``overlap`` asynchronously. All dp ranks must run the
same autograd graph, as with DistributedDataParallel. Details: ``docs/zero.md``.
"""

from __future__ import annotations

import os
from collections import deque

import torch

from plait.zero.comm import Comms, Pending, reduce_segment_grads
from plait.zero.flat import FlatGroup, Segment

MAX_IN_FLIGHT = 4  # async reductions allowed before the oldest is waited for (bounds buffer memory)


def gives_back(device: torch.device, host: bool, per_unit: bool) -> bool:
    """Whether device grad shards should free their storage between steps: not on the host (offload: the host
    stepper owns them), always on CPU, on other accelerators never; on CUDA with one shard per stage-3 unit
    (``per_unit``, more than one unit: blocks of 4 bytes x a unit's parameters / dp, taken back one at a time as
    backward reaches it, as FSDP2's sharded gradients), or else with the allocator's expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``). Without them a whole-model shard (stages 1-2) must
    find one free block again each backward, among the activations that took its place meanwhile, and a model
    that fits with the shard kept can run out of memory."""
    if host or device.type not in ("cpu", "cuda"):
        return False
    if device.type == "cpu" or per_unit:
        return True
    conf = (
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        + ","
        + os.environ.get("PYTORCH_ALLOC_CONF", "")
    )
    return "expandable_segments:true" in conf.replace(" ", "").lower()


class GradReducer:
    """Reduces segment gradients into ``grad_shards[g]`` (float32 ``[groups[g].shard_numel]``).

    Args:
        groups: the layout (``flat.build_layout``).
        grad_shards: one float32 accumulator per flat group; the first reduction of a step is copied in,
            later ones (gradient-accumulation micro-steps) are added.
        comms: the groups each segment is reduced over (``plait.zero.comm.Comms``; None groups: one process).
        reduce_dtype: dtype gradients travel in (float32 default; bf16/fp16 halve the traffic).
        overlap: launch collectives asynchronously.
        eager: reduce from hooks as gradients appear (stages 2, 3) instead of at the boundary.
        land: ZeRO-Offload hook ``land(seg, out, fresh)`` that takes over each landing (``out``: the
            reduced ``[S]`` slice on the device, or None when it was packed straight into the
            grad shard; ``fresh``: first landing of the step); see ``plait.zero.offload``.
        give_back: free the grad shards' storage between steps (``zero``); see ``gives_back``.
    """

    def __init__(
        self,
        groups: list[FlatGroup],
        grad_shards: list[torch.Tensor],
        comms: Comms,
        reduce_dtype: torch.dtype,
        overlap: bool,
        eager: bool,
        land=None,
        give_back: bool = False,
    ):
        self.groups, self.grad_shards, self.land, self.give_back = (
            groups,
            grad_shards,
            land,
            give_back,
        )
        self.comms = comms
        self.reduce_dtype, self.overlap, self.eager = reduce_dtype, overlap, eager
        self.segments: list[Segment] = [seg for g in groups for seg in g.segments]
        self._segment_of = {id(slot.param): seg for seg in self.segments for slot in seg.slots}
        self._remaining: dict[int, int] = {}
        self._launched: set[int] = set()
        self._in_flight: deque[tuple[Pending, torch.Tensor, Segment]] = deque()
        # Segments whose shard slice holds no gradient yet this step: the first reduction lands by
        # copy (no zero-fill, no read-modify-write), later micro-steps add. Every segment lands at
        # least once per backward pass (``flush``/``reduce_all`` launch all), so no stale values.
        self._fresh: set[int] = set()
        self.zero()
        self._reset_counts()

    # ---- launching and landing ----------------------------------------------------------
    def _reset_counts(self) -> None:
        self._remaining = {id(seg): len(seg.slots) for seg in self.segments}
        self._launched.clear()

    def _slice(self, seg: Segment) -> torch.Tensor:
        return self.grad_shards[seg.group][seg.shard_offset : seg.shard_offset + seg.shard_size]

    def _direct(self, seg: Segment) -> torch.Tensor | None:
        """The grad-shard slice the reduction may write in place: the first of the step (nothing to add
        to), in the shard's dtype and on its device; with several ranks, a reduce-scatter (stages 1-3) to a
        device stepper (no ``land``). None otherwise."""
        shard = self.grad_shards[seg.group]
        if (
            id(seg) not in self._fresh
            or self.reduce_dtype != shard.dtype
            or shard.device != seg.slots[0].param.device
        ):
            return None
        if self.comms.of(seg).size > 1 and (seg.world == 1 or self.land is not None):
            return None
        return self._slice(seg)

    def _launch(self, seg: Segment) -> None:
        self._launched.add(id(seg))
        shard = self.grad_shards[seg.group]
        if (
            shard.untyped_storage().nbytes() == 0
        ):  # given back after the last step; every slice lands anew
            shard.untyped_storage().resize_(shard.numel() * shard.element_size())
        direct, comm = self._direct(seg), self.comms.of(seg)
        pending, out = reduce_segment_grads(
            seg,
            comm.group,
            comm.size,
            self.reduce_dtype,
            release=True,
            async_op=self.overlap,
            out=direct,
            divisor=comm.divisor,
        )
        if direct is not None:
            self._fresh.discard(id(seg))  # written in place: landing adds nothing
            if comm.size == 1:
                if self.land is not None:
                    self.land(seg, None, True)
                return
            out = None
        self._in_flight.append((pending, out, seg))
        limit = MAX_IN_FLIGHT if self.overlap else 0
        while len(self._in_flight) > limit:
            self._land_oldest()

    def _land_oldest(self) -> None:
        pending, out, seg = self._in_flight.popleft()
        pending.wait()
        if out is None:
            return  # reduce-scattered into the grad shard itself
        if self.land is not None:
            fresh = id(seg) in self._fresh
            self._fresh.discard(id(seg))
            self.land(seg, out, fresh)
        elif id(seg) in self._fresh:
            self._slice(seg).copy_(out)
            self._fresh.discard(id(seg))
        else:
            self._slice(seg).add_(out)

    def wait(self) -> None:
        """Wait for every launched reduction and add it into the grad shards. A slice nothing landed in
        since ``zero()`` (a step without backward) reads as zeros."""
        while self._in_flight:
            self._land_oldest()
        for seg in self.segments:
            if id(seg) in self._fresh:
                shard = self.grad_shards[seg.group]
                if shard.untyped_storage().nbytes() == 0:
                    shard.untyped_storage().resize_(shard.numel() * shard.element_size())
                self._slice(seg).zero_()

    # ---- stage 0/1: at the boundary --------------------------------------------------------
    def reduce_all(self) -> None:
        """Reduce every segment's accumulated ``param.grad`` (stages 0, 1) and wait. Collective."""
        for seg in self.segments:
            self._launch(seg)
        self.wait()
        self._reset_counts()

    # ---- stage 2/3: during backward --------------------------------------------------------
    def on_grad(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook body: launch the segment once all its gradients are in."""
        seg = self._segment_of.get(id(param))
        if seg is None or id(seg) in self._launched:
            return
        self._remaining[id(seg)] -= 1
        if self._remaining[id(seg)] == 0:
            self._launch(seg)

    def flush(self) -> None:
        """End of a backward pass: reduce segments still waiting (in layout order, the same on
        every rank), wait for all, and re-arm the counters. Collective."""
        for seg in self.segments:
            if id(seg) not in self._launched:
                self._launch(seg)
        self.wait()
        self._reset_counts()

    def zero(self) -> None:
        """Start a new step: the next reduction into each slice overwrites it (see ``_fresh``), so with
        ``give_back`` the grad shards free their memory until then (their storage is resized to 0 bytes, as
        ``zero_grad(set_to_none=True)`` frees gradients; the first landing of the next backward restores
        it)."""
        for (
            pending,
            _,
            _,
        ) in self._in_flight:  # a backward that raised: its reductions write nowhere later
            pending.wait()
        self._in_flight.clear()
        self._reset_counts()
        self._fresh = {id(seg) for seg in self.segments}
        if self.give_back:
            for shard in self.grad_shards:
                if shard.untyped_storage().resizable():
                    shard.untyped_storage().resize_(0)
