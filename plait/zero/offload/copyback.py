"""The host step of one gradient segment and the copy of its updated weights back to the device
(ZeRO-Offload, Ren et al., USENIX ATC'21, Sec. 4.2: CPU optimizer step, then the fp16/bf16 parameter
copy host -> device). Runs on the ``HostStepper``'s worker thread."""

from __future__ import annotations

import time

import torch

from plait.zero.flat import Segment
from plait.zero.pinned import host_empty
from plait.zero.stepper import ShardSet


class CopyBack:
    """Steps segments on the host and copies their compute-dtype shards to the device.

    Args:
        shards: the ``ShardSet`` (host fp32 ``masters``, ``grad_shards``, ``HostOptimizer``, ``groups``).
        device: the module's device.
        param_offload: stage-3 parameter shards live on the host (``OffloadOptions.param``): the kernel
            writes them directly and nothing is copied to the device.
        pin: page-lock the bf16/fp16 copy-out buffers (``[shard_numel]`` per flat group).
    """

    def __init__(self, shards: ShardSet, device: torch.device, param_offload: bool, pin: bool):
        self.shards, self.param_offload = shards, param_offload
        self.device, self.cuda = device, device.type == "cuda"
        # bf16/fp16 copy-out targets on the host, one per flat group the host steps (none for a group whose
        # states stay on the device, offload_optimizer.ratio < 1; none with offload_param at stage 3: the
        # kernel writes the host parameter shards directly).
        self.lowp: list[torch.Tensor | None] = []
        for g in shards.groups:
            needs = (
                not g.key.resident
                and g.key.dtype != torch.float32
                and any(self.dest(s) is not None for s in g.segments)
            )
            self.lowp.append(host_empty(g.shard_numel, g.key.dtype, pin) if needs else None)
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.copied: dict[
            int, object
        ] = {}  # worker only: id(seg) -> event of its last host->device copy
        self.cpu_end: float | None = (
            None  # perf_counter() after the last host step (adaptive split)
        )

    def dest(self, seg: Segment) -> torch.Tensor | None:
        """Where the updated compute-dtype ``[S]`` shard of ``seg`` goes on the device (None: host shard)."""
        if seg.local is not None:
            return None if self.param_offload else seg.local
        return seg.full[seg.lo : seg.lo + seg.shard_size]

    def step_segment(self, seg: Segment, grad_coef: float, used=None):
        """Worker: host step of ``seg`` (gradient multiplied by ``grad_coef``) and its copy back to the
        device, queued on the h2d stream after ``used`` (backward's last read of the segment).
        Returns the event recorded after that copy (None without CUDA or device destination).
        Touches no per-step state of the stepper: it may run after ``step()`` returned."""
        shards, host_opt = self.shards, self.shards.optimizer
        event = None
        previous = self.copied.pop(id(seg), None)
        if previous is not None:
            previous.synchronize()  # last step's copy out of the bf16 host buffer has finished
        gi, lo, n = seg.group, seg.shard_offset, seg.shard_size
        master, lowp = shards.masters[gi], self.lowp[gi]
        dest = self.dest(seg)
        if seg.key.dtype == torch.float32:
            out = None
        elif dest is None:
            out = seg.local  # offload_param: the host parameter shard itself
        else:
            out = lowp[lo : lo + n]
        host_opt.step_range(
            master, lo, n, shards.grad_shards[gi], lowp_out=out, grad_coef=grad_coef
        )
        self.cpu_end = time.perf_counter()
        src = master.detach()[lo : lo + n] if out is None else out
        if dest is None:
            if out is None:
                seg.local.copy_(src)
        elif self.cuda:
            with torch.cuda.stream(self.h2d):
                if used is not None:
                    self.h2d.wait_event(used)
                dest.copy_(src, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # the worker sleeps in synchronize()
                event.record(self.h2d)
            self.copied[id(seg)] = event
        else:
            dest.copy_(src)
        return event
