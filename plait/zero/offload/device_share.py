"""Device-assisted host step: the device computes part of an offloaded Adam/AdamW update.

``OffloadOptions(device_step_fraction=f)`` hands the first ``f`` of the partition in forward order to
``DeviceShare``: their fp32 masters and moments stay in host memory, are copied to the device, updated
from the gradient that never left it (``adam_update_``: the CPU kernel's formula and roundings, so
bit-identical to the all-host step) and copied back, while the CPU kernels step the rest.
``"auto"`` moves the split after each step towards equal CPU and device times.

Restrictions (checked when the ``HostStepper`` is built): Adam/AdamW only, gradient accumulation 1,
compute-dtype weights on the device (stages 1-2, stage 3 without offload_param), fp32 moments.
Why and how: ``docs/offload.md``; measurements: ``benchmarks/results/offload_design_numbers.md``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import nullcontext

import torch

from plait.zero.flat import Segment
from plait.zero.pinned import pin_existing
from plait.zero.stepper import ShardSet


class DeviceShare:
    """Steps the first ``count`` segments of ``eligible`` on the device (module docstring).

    Args:
        shards: the ``ShardSet`` (its host fp32 ``masters`` and ``HostOptimizer``).
        device: the module's device.
        dest: ``dest(seg)``: the device ``[S]`` tensor the updated compute-dtype shard of ``seg`` goes to.
        eligible: every segment the device could step (weights on the device), in forward order.
        count: how many of the first ``eligible`` it steps.
        total: elements of the whole partition (the CPU steps those the device does not).
        adaptive: after every step, move the boundary towards equal CPU and device times
            (``rebalance``); results do not depend on it (the two updates are bit-identical and
            the gradient norm is computed on the device for every segment either way).
        resident: segments whose masters and moments live in device memory (``plait.zero.offload.placement``):
            always stepped here, in place, with no copy; not part of ``eligible`` or ``total``.
    """

    def __init__(
        self,
        shards: ShardSet,
        device: torch.device,
        dest,
        eligible: list[Segment],
        count: int,
        total: int,
        adaptive: bool = False,
        resident: list[Segment] = (),
    ):
        self.shards, self.dest = shards, dest
        self.device, self.cuda = device, device.type == "cuda"
        self.eligible, self.count, self.total, self.adaptive = eligible, count, total, adaptive
        self.resident = frozenset(id(s) for s in resident)
        self.ids = self.resident | {id(s) for s in eligible[:count]}
        self.grads: dict[int, torch.Tensor] = {}  # id(seg) -> device gradient of this step
        self.events: list = []  # copies back to the host still in flight
        self.turn = 0
        self.history = deque([count], maxlen=1024)  # segments on the device, last steps (adaptive)
        self.device_rate: float | None = None  # elements/s of the device share, last measured
        self._start = None  # timing of the device share of the last step
        self._seconds = 0.0
        if self.cuda:
            self.streams = [torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)]
            host = shards.optimizer
            chosen = eligible if adaptive else eligible[:count]
            for gi in {s.group for s in chosen} - {
                s.group for s in resident
            }:  # page-lock the streamed states
                master = shards.masters[gi]
                pin_existing(master)
                k = host.kernels[master]
                for name in k._state_names:
                    pin_existing(getattr(k, name))

    def __contains__(self, seg: Segment) -> bool:
        return id(seg) in self.ids

    def land(self, seg: Segment, grad: torch.Tensor) -> None:
        """Main thread, backward: keep ``grad`` (``[shard_size]`` on the device) for the step."""
        self.grads[id(seg)] = grad

    def step(self, seg: Segment, grad_coef: float):
        """Main thread, at ``step()``: queue the update of ``seg`` (gradient multiplied by ``grad_coef``) and
        its copies; returns the event after its device weights are written (None without CUDA: all done
        on return). ``wait`` waits for the copies of the host states."""
        host = self.shards.optimizer
        gi, lo, n = seg.group, seg.shard_offset, seg.shard_size
        master = self.shards.masters[gi]
        k = host.kernels[master]
        dest = self.dest(seg)
        grad = self.grads.pop(id(seg))
        host_w, host_m, host_v = (
            master.detach()[lo : lo + n],
            k.exp_avg[lo : lo + n],
            k.exp_avg_sq[lo : lo + n],
        )
        # resident states: updated where they live (bf16/int8 moments have no streamed share: ``HostStepper``)
        if master.device == self.device and (
            self.cuda or getattr(host, "state_dtype", "fp32") != "fp32"
        ):
            return self._step_resident(master, lo, n, grad, grad_coef, dest)
        stream, event = None, None
        t0 = time.perf_counter()
        if self.cuda:
            stream = self.streams[self.turn % 2]
            self.turn += 1
            stream.wait_stream(
                torch.cuda.current_stream(self.device)
            )  # backward is done with grad, dest
            if self._start is None:
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record(stream)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            w = host_w.to(self.device, non_blocking=True)
            m = host_m.to(self.device, non_blocking=True)
            v = host_v.to(self.device, non_blocking=True)
            adam_update_(w, grad, m, v, k, grad_coef)
            dest.copy_(w)
            if self.cuda:
                event = torch.cuda.Event()  # the next forward waits for this one only
                event.record(stream)
                host_w.copy_(w, non_blocking=True)
                host_m.copy_(m, non_blocking=True)
                host_v.copy_(v, non_blocking=True)
                done = torch.cuda.Event(
                    blocking=True, enable_timing=True
                )  # host readers of the states wait
                done.record(stream)
                self.events.append(done)
        if stream is not None:
            grad.record_stream(stream)
        else:
            self._seconds += time.perf_counter() - t0
        return event

    def _step_resident(self, master, lo: int, n: int, grad, grad_coef: float, dest):
        """The update of a segment whose states live on the device, on the compute stream (it follows
        backward, and the next forward follows it): no copy, no side stream; moments in any ``state_dtype``
        (``HostOptimizer.step_range`` of a device master). Returns None (done in order)."""
        self.shards.optimizer.step_range(master, lo, n, grad, grad_coef=grad_coef)
        dest.copy_(master.detach()[lo : lo + n])

    def wait(self) -> None:
        """Host: every queued copy back to host memory has finished (host states may be read)."""
        events, self.events = self.events, []
        for e in events:
            e.synchronize()
        if events and self._start is not None:
            self._seconds = max(self._start.elapsed_time(e) for e in events) / 1e3
            self._start = None

    def take_seconds(self) -> float:
        """Seconds the device share of the last step took (after ``wait``), then reset."""
        out, self._seconds = self._seconds, 0.0
        return out

    def rebalance(self, cpu_seconds: float, device_seconds: float) -> None:
        """Adaptive: when the device share finished well before the CPU share (< 0.85x its time) or well
        after (> 1.15x), move the boundary half-way to the split that equalizes the two at the element
        rates just measured (at least one segment; one segment first while no device rate was ever measured,
        so a device slower than the CPU is tried once). Takes effect from the next backward."""
        if not self.adaptive or 0.85 * cpu_seconds <= device_seconds <= 1.15 * cpu_seconds:
            return
        sizes = [s.shard_size for s in self.eligible]
        on_device = sum(sizes[: self.count])
        if self.count > 0 and device_seconds > 0:
            self.device_rate = on_device / device_seconds  # remembered: no probing again from 0
        if self.device_rate is None or cpu_seconds <= 0 or self.total <= on_device:
            target = self.count + (1 if device_seconds < cpu_seconds else -1)
        else:
            device_rate, cpu_rate = self.device_rate, (self.total - on_device) / cpu_seconds
            want, acc, balanced = self.total * device_rate / (device_rate + cpu_rate), 0, 0
            while balanced < len(sizes) and acc + sizes[balanced] / 2 < want:
                acc += sizes[balanced]
                balanced += 1
            diff = balanced - self.count
            target = self.count + (int(math.copysign(max(1, abs(diff) // 2), diff)) if diff else 0)
        self.count = min(max(target, 0), len(sizes))
        self.ids = self.resident | {id(s) for s in self.eligible[: self.count]}
        self.history.append(self.count)

    def reset(self) -> None:
        """Forget this step's gradients (after ``step`` or ``zero_grad``)."""
        self.grads.clear()


def adam_update_(
    w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, k, grad_coef: float
) -> None:
    """One Adam/AdamW step in place on float32 ``w, m, v`` (``[n]``) from ``grad`` (``[n]``, any float dtype),
    with the hyper-parameters, step count and lr of the CPU kernel ``k`` (``plait.kernels.CPUAdam``).

    The operations and their rounding are those of ``plait.kernels.cpu_adam`` (Kingma & Ba 2015, Alg. 1;
    decoupled decay: Loshchilov & Hutter 2019, Alg. 2): float32 scalars, every product and sum rounded
    on its own (no fused multiply-add, which torch's ``add_(alpha=)`` and ``lerp_`` would use), IEEE
    division and correctly rounded square root. So a segment stepped here is bit-identical to the CPU
    kernel's result (``tests/test_offload.py``; on CUDA ``tests/gpu/run_offload_gpu.py``).
    """
    lr, (b1, b2), t = k._step_lr, k.betas, k.step_count
    bc1 = 1.0 - b1**t if k.bias_correction else 1.0
    bc2 = 1.0 - b2**t if k.bias_correction else 1.0
    # every scalar rounded to float32 first, as the kernel's are: then a product or quotient of two
    # float32 values rounds the same whether torch computes it in float32 or in double
    beta1, one_minus_beta1, beta2, one_minus_beta2 = (
        _f32(b1),
        _f32(1.0 - b1),
        _f32(b2),
        _f32(1.0 - b2),
    )
    g = grad.to(torch.float32, copy=True).mul_(_on(w, grad_coef))
    if k.adamw_mode:
        w.mul_(_f32(1.0 - lr * k.weight_decay))
    elif k.weight_decay != 0.0:
        g.add_(w * _f32(k.weight_decay))
    m.mul_(beta1).add_(g * one_minus_beta1)
    v.mul_(beta2).add_((g * g).mul_(one_minus_beta2))
    # CUDA's sqrtf is correctly rounded; torch's CPU float32 sqrt (SLEEF, 0.5001 ulp) is not always, so on
    # the CPU take it in float64 and round once (exactly IEEE float32 sqrt: 53 >= 2 * 24 + 2 bits)
    root = v.sqrt() if v.is_cuda else v.double().sqrt_().float()
    denom = root.div_(_on(w, math.sqrt(bc2))).add_(_f32(k.eps))
    w.sub_(m.div(denom).mul_(_f32(lr / bc1)))


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (returned as a Python float)."""
    return float(torch.tensor(x, dtype=torch.float32))


def _on(like: torch.Tensor, x: float) -> torch.Tensor:
    """``x`` as a float32 0-dim tensor on ``like``'s device: a divisor. CUDA kernels replace division by a
    host scalar with multiplication by its reciprocal (not always the correctly rounded quotient);
    a device tensor keeps the IEEE division the CPU kernel does."""
    return torch.full((), x, dtype=torch.float32, device=like.device)  # a fill kernel: no host copy
