"""Device-assisted host step: the device computes part of an offloaded Adam/AdamW update.

With ZeRO-Offload the optimizer step runs on the host and, with exact clipping, cannot start before
backward ends; on one GPU it is then the critical path (886M parameters: ~0.23 s of host memory
traffic at ~30 bytes/parameter, against a 0.12 s forward+backward). Meanwhile the device and the PCIe
link idle. ``OffloadOptions(device_step_fraction=f)`` hands the first ``f`` of the partition in
forward order to the device: their fp32 master weights and Adam moments stay in host memory (the
memory saving of ZeRO-Offload is kept), are copied to the device, updated there from the gradient
that never left the device, and copied back, while the CPU kernels step the rest. Per parameter that
moves 12 bytes each way over PCIe instead of 30 bytes through the CPUs, so both run at once and the
step ends when the slower of the two does. The first segments in forward order are chosen because
their gradients land last in backward (no device->host copy is then waiting at the end of backward)
and the next forward needs them first.

The update is the CPU kernel's formula (``plait.kernels.cpu_adam``, torch.optim.Adam/AdamW) in
float32 torch ops, so results equal the all-host step to float32 rounding (``tests/test_offload.py``
checks 1e-6). Two CUDA streams alternate between segments so one segment's host->device copies
overlap the previous one's device->host copies; a segment's temporaries (about 20 bytes/element:
weights, moments, fp32 gradient, denominator) are freed as soon as its copies are queued, so at most
two segments' worth is allocated at a time.

Restrictions (checked when the pipeline is built): Adam/AdamW only, gradient accumulation 1, and
segments whose compute-dtype weights live on the device (stages 1-2, stage 3 without offload_param).
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from plait.zero.flat import Segment
from plait.zero.pinned import pin_existing


class DeviceStepper:
    """Steps the segments ``chosen`` on the device (module docstring).

    Args:
        pipeline: the ``OffloadPipeline`` (its optimizer, device, streams, ``_device_dest``).
        chosen: the segments the device updates.
    """

    def __init__(self, pipeline, chosen: list[Segment]):
        self.pipe, self.opt = pipeline, pipeline.opt
        self.device, self.cuda = pipeline.device, pipeline.cuda
        self.ids = {id(s) for s in chosen}
        self.grads: dict[int, torch.Tensor] = {}    # id(seg) -> device gradient of this step
        self.sumsq: dict[int, torch.Tensor] = {}    # id(seg) -> device scalar: its squared norm (counted part)
        self.events: list = []                      # copies back to the host still in flight
        self.turn = 0
        if self.cuda:
            self.streams = [torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)]
            host = self.opt.optimizer
            groups = {s.group for s in chosen}
            for gi in groups:                      # page-lock the host states the device streams
                master = self.opt.masters[gi]
                pin_existing(master)
                k = host.kernels[master]
                for name in k._state_names:
                    pin_existing(getattr(k, name))

    def __contains__(self, seg: Segment) -> bool:
        return id(seg) in self.ids

    def land(self, seg: Segment, grad: torch.Tensor, excluded: list[tuple[int, int]], skip_norm: bool) -> None:
        """Main thread, backward: keep ``grad`` (``[shard_size]`` on the device) for the step and queue its
        squared norm (minus ``excluded`` ranges; zero when ``skip_norm``) on the device."""
        self.grads[id(seg)] = grad
        if skip_norm:
            self.sumsq[id(seg)] = torch.zeros((), dtype=torch.float64, device=grad.device)
            return
        sq = _sum_squares64(grad)
        for a, b in excluded:
            sq = sq - _sum_squares64(grad[a:b])
        self.sumsq[id(seg)] = sq

    def norm_partial(self) -> torch.Tensor | None:
        """Sum of the landed segments' squared norms (float64 device scalar), or None when none landed."""
        if not self.sumsq:
            return None
        return torch.stack(list(self.sumsq.values())).sum()

    def step(self, seg: Segment, grad_scale: float):
        """Main thread, at ``step()``: queue the update of ``seg`` (gradient divided by ``grad_scale``) and
        its copies; returns the event after its device weights are written (None without CUDA: all done
        on return). ``wait`` waits for the copies of the host states."""
        opt, host = self.opt, self.opt.optimizer
        gi, lo, n = seg.group, seg.shard_offset, seg.shard_size
        master = opt.masters[gi]
        k = host.kernels[master]
        dest = self.pipe._device_dest(seg)
        grad = self.grads.pop(id(seg))
        host_w, host_m, host_v = master.detach()[lo:lo + n], k.exp_avg[lo:lo + n], k.exp_avg_sq[lo:lo + n]
        stream, event = None, None
        if self.cuda:
            stream = self.streams[self.turn % 2]
            self.turn += 1
            stream.wait_stream(torch.cuda.current_stream(self.device))   # backward is done with grad, dest
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            w = host_w.to(self.device, non_blocking=True)
            m = host_m.to(self.device, non_blocking=True)
            v = host_v.to(self.device, non_blocking=True)
            adam_update_(w, grad, m, v, k, grad_scale)
            dest.copy_(w)
            if self.cuda:
                event = torch.cuda.Event()          # the next forward waits for this one only
                event.record(stream)
                host_w.copy_(w, non_blocking=True)
                host_m.copy_(m, non_blocking=True)
                host_v.copy_(v, non_blocking=True)
                done = torch.cuda.Event(blocking=True)  # host readers of the states wait for this one
                done.record(stream)
                self.events.append(done)
        if stream is not None:
            grad.record_stream(stream)
        return event

    def wait(self) -> None:
        """Host: every queued copy back to host memory has finished (host states may be read)."""
        events, self.events = self.events, []
        for e in events:
            e.synchronize()

    def reset(self) -> None:
        """Forget this step's gradients and norms (after ``step`` or ``zero_grad``)."""
        self.grads.clear()
        self.sumsq.clear()


def _sum_squares64(x: torch.Tensor, chunk: int = 1 << 23) -> torch.Tensor:
    """``sum(x**2)`` as a float64 scalar on ``x``'s device, accumulated in float64 (as the host's
    ``sum_of_squares``), widening at most ``chunk`` elements at a time (8 bytes each)."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for a in range(0, x.numel(), chunk):
        part = x[a:a + chunk].to(torch.float64)
        total += torch.dot(part, part)
    return total


def adam_update_(w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, k, grad_scale: float) -> None:
    """One Adam/AdamW step in place on float32 ``w, m, v`` (``[n]``) from ``grad`` (``[n]``, any float dtype),
    with the hyper-parameters, step count and lr of the CPU kernel ``k`` (``plait.kernels.CPUAdam``).

    The operations and their rounding are those of ``plait.kernels.cpu_adam`` (Kingma & Ba 2015, Alg. 1;
    decoupled decay: Loshchilov & Hutter 2019, Alg. 2): float32 scalars, every product and sum rounded
    on its own (no fused multiply-add, which torch's ``add_(alpha=)`` and ``lerp_`` would use), IEEE
    division and square root. So a segment stepped here is bit-identical to the CPU kernel's result.
    """
    lr, (b1, b2), t = k._step_lr, k.betas, k.step_count
    bc1 = 1.0 - b1 ** t if k.bias_correction else 1.0
    bc2 = 1.0 - b2 ** t if k.bias_correction else 1.0
    g = grad.to(torch.float32, copy=True).div_(grad_scale)
    if k.adamw_mode:
        w.mul_(1.0 - lr * k.weight_decay)
    elif k.weight_decay != 0.0:
        g.add_(w * k.weight_decay)
    m.mul_(b1).add_(g * (1.0 - b1))
    v.mul_(b2).add_((g * g).mul_(1.0 - b2))
    denom = v.sqrt().div_(math.sqrt(bc2)).add_(k.eps)
    w.sub_(m.div(denom).mul_(lr / bc1))
