"""ZeRO-Offload: the host side of ``ZeroOptimizer`` (optimizer state, and stage-3 parameters, in host
memory), with the CPU optimizer step overlapped with backward and with the device copies.

Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC'21: per rank the
fp32 master shard, the fp32 gradient shard and the optimizer state (Adam: 16 bytes/param of the rank's
``1/dp`` partition) live on the host; the device keeps only the compute-dtype parameters (and with
``offload_param`` not even those between uses, Sec. 4 / ZeRO-Infinity's parameter offload).

Data path of one optimizer step (``G`` = one *segment*, the unit of gradient reduction; CUDA streams
in brackets; on a CPU-only machine every copy is a plain host copy and the streams do not exist)::

    backward                       side stream [d2h]               worker thread (numba, N threads)
    --------                       -----------------               ---------------------------------
    G reduce-scattered  ---------> copy G -> pinned host grad ---> (GAS>1: add into the host shard)
    (backward continues)                                           sum of squares of G (norm, overflow)
                                                                   early mode: CPU step of G now
    ...                                                            ...
    step(): all G landed -> norm all-reduced -> clip coefficient
                                                                   deferred mode: CPU step of each G
                                   [h2d] copy updated bf16 G  <--- (fused bf16/fp16 copy-out of the step)
                                         back to the device
    step() returns; next forward: per segment, a pre-hook waits for its copy (device waits on [h2d]
    event) and all-gathers its updated shard (dp > 1) right before first use

The host gradient shard is fp32, except with bf16 weights at GAS 1 (one rank, or a bf16 reduction):
then the reduced gradient is bf16 already and stays bf16 on the host (half the device->host bytes and
2 bytes/param less host memory); the kernels and the norm read it as is and widen it exactly.

Exactness of clipping and fp16 overflow (``step_mode``): every segment's squared gradient norm is
computed as it lands, overlapped with backward: at GAS 1 on the device before its copy to the host
(``clip.sum_squares64``: float64, an order fixed by the segment length, so the norm does not depend on
which side steps the segment), at GAS > 1 on the host once accumulated (numba, float64). At ``step()``
the global norm costs one scalar all-reduce; inf/nan anywhere makes it non-finite (fp16 overflow). The CPU step of a segment needs the clip coefficient
``min(1, max_norm / norm) / loss_scale``, known only once *every* segment has landed. Hence:

* **early** (``max_grad_norm`` off, no fp16 loss scaler, so the coefficient is exactly 1, no
  device share, see ``plait.zero.offload_device``, and the non-finite guard off, since a segment stepped
  during backward cannot be skipped afterwards: ``ZeroOptimizer(skip_nonfinite=False)``): each
  segment is stepped by the worker as soon as it lands, while backward computes earlier layers, and its
  bf16 copy-back is queued right away. This is the full overlap of the ZeRO-Offload paper.
* **deferred** (clipping on, or fp16): the segments' CPU steps start at ``step()`` with the exact
  coefficient (no speculation, no use of a stale norm), in forward order, each followed at once by
  its non-blocking host->device copy, so copies overlap the next segment's CPU step; the device->host
  copies, the gradient accumulation and the norm partials already overlapped backward. A non-finite
  norm (fp16 overflow, a nan gradient in any precision) skips the step before any state is touched.

Overlap with the next forward (``OffloadOptions.overlap_step``, default on): ``step()`` returns once
the host steps are *queued*; it does not wait for them. Each segment's ticket (``plait.zero.offload_ready``)
is consumed right before the device first reads the segment: a forward pre-hook on every module
holding one of its parameters directly (stages 1-2, stage-3 persistent segments), or the stage-3
gatherer before it fetches a unit (``ParamGatherer.gate``). Consuming waits for the worker to have
queued the segment's copy-back (host), makes the compute stream wait on that copy's event (device, no
host sync) and, at dp > 1 where ranks hold parameters whole, all-gathers the updated shards of the
segments consumed (in step order, at the same hooks on every rank, so the collectives match). So the
host step of layer ``L+1`` runs while the GPU computes layer ``L`` of the next forward, and the values
read are exactly those of a synchronous step. Everything else that reads parameters, masters or
optimizer state, or writes gradients, first waits for the whole step (``synchronize``): the next
backward, the next ``step``, ``zero_grad``, ``write_back``, ``gathered_parameters``, ``shard_state``
(checkpoint saves), ``load_shard_state``, ``close``. Stage-3 prefetch skips segments not yet consumed
(they are fetched on demand). Limit: a parameter read by code outside the forward of every module that
holds it (``F.linear(x, other_module.weight)``) is not waited for: call ``ZeroOptimizer.synchronize()``
first or turn ``overlap_step`` off. The worker steps segments in module registration order
(``offload_ready.forward_order``), a proxy for forward order; a different order is still exact.

Results equal the non-offloaded ``ZeroOptimizer`` stepping with the same kernels bit for bit: both
take the clip coefficient from a float64 norm (``clip.global_grad_norm``) and multiply the float32
gradient by it (``tests/test_offload.py``). Against torch's Adam/AdamW the kernels agree to float32
rounding per step (~1e-7; ``tests/test_kernels.py``).

Gradient accumulation (GAS > 1): reduced gradients of earlier micro-steps are accumulated in the host
fp32 gradient shard (first landing copies, later ones add; no fp32 gradient buffer on the device);
only landings of the last micro-step (``micro_steps + 1 == GAS`` during backward; stage 1 reduces at
the boundary) compute norms or step. Segments not yet finalized at ``step()`` (e.g. a pipeline engine
counting micro-steps after its schedule) are finalized there.

Early mode caveat: once the last micro-step's backward ran, the host step of each segment is already
applied; ``zero_grad()`` then cannot discard it (``step()`` completes it). Use deferred mode
(``OffloadOptions(early_step=False)``) if a step may be abandoned after backward.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.kernels.lowp import sum_of_squares
from plait.parallel.collectives import group_rank, group_size
from plait.zero.clip import clip_coefficient, sum_squares64
from plait.zero.flat import Segment, gather_segments
from plait.zero.offload_device import DeviceStepper
from plait.zero.offload_ready import Readiness, forward_order, module_needs
from plait.zero.pinned import host_empty
from plait.zero.stage3 import ParamGatherer


@dataclass(frozen=True)
class OffloadOptions:
    """What ``ZeroOptimizer(offload=...)`` moves to the host.

    Args:
        optimizer: fp32 masters, gradient shards and optimizer state on the host; the optimizer
            (``HostOptimizer``: Adam/AdamW/Lion) steps there. Stages 1-3.
        param: stage 3: compute-dtype parameter shards on the host between uses (copied to the device
            right before each unit's all-gather).
        pin_memory: page-lock the buffers that cross the bus (fp32 gradient shard, bf16/fp16 copy-out,
            stage-3 parameter shards) when CUDA is available; needed for asynchronous copies.
        num_threads: numba threads of the CPU optimizer (None: numba's pool, i.e. every core).
        early_step: allow the early mode (module docstring) when the clip coefficient is exactly 1.
        overlap_step: ``step()`` returns before the host step ends; the next forward waits per
            segment (module docstring). False: ``step()`` waits for every segment.
        device_step_fraction: in [0, 1): the first this fraction of the optimizer partition (elements, in
            forward order) is updated by the device from the host-resident states while the CPU steps
            the rest (``plait.zero.offload_device``); 0: everything on the CPU. Adam/AdamW, GAS 1.
        device_step_adaptive: start from ``device_step_fraction`` and, after every step, move the split by
            one segment towards equal CPU and device times (exact either way).

    Raises:
        ValueError: ``device_step_fraction`` outside [0, 1).
    """

    optimizer: bool = True
    param: bool = False
    pin_memory: bool = True
    num_threads: int | None = None
    early_step: bool = True
    overlap_step: bool = True
    device_step_fraction: float = 0.0
    device_step_adaptive: bool = False

    def __post_init__(self):
        if not 0.0 <= self.device_step_fraction < 1.0:
            raise ValueError(f"device_step_fraction={self.device_step_fraction} must be in [0, 1) (the share of the "
                             "optimizer step the device computes; 0 = all on the CPU)")


class OffloadGatherer(ParamGatherer):
    """Stage-3 gatherer whose parameter shards (``Segment.local``) live on the host: each fetch copies
    the shards to ``device`` (non-blocking from pinned memory, on the current stream) and all-gathers
    there. Same arguments as ``ParamGatherer`` plus ``device``."""

    def __init__(self, *args, device: torch.device, **kwargs):
        self.device = torch.device(device)
        super().__init__(*args, **kwargs)

    def _fetch(self, segs: list[Segment], async_op: bool) -> None:
        if not segs:
            return
        self.stats["prefetched" if async_op else "fetched"] += len(segs)
        outs = [torch.empty(s.padded, dtype=s.local.dtype, device=self.device) for s in segs]
        ins = [s.local.to(self.device, non_blocking=True) for s in segs]
        launched = gather_segments(outs, ins, self.dp_group, self.dp_size, self.allgather_bucket_size,
                                   async_op=async_op)
        if not async_op or not launched:
            for s, out in zip(segs, outs):
                s.set_views(out)
            return
        for pending, run in launched:
            pending.keep.extend(ins[k] for k in run)
            record = (pending, [segs[k] for k in run], [outs[k] for k in run])
            for k in run:
                self.in_flight[id(segs[k])] = record


class OffloadPipeline:
    """The host half of a ``ZeroOptimizer`` with ``offload.optimizer`` (module docstring).

    ``ZeroOptimizer`` builds it after its masters (host fp32), grad shards (host fp32) and
    ``HostOptimizer``; ``GradReducer`` calls ``land`` for every reduced segment and ``ZeroOptimizer.step``
    calls ``step`` at the accumulation boundary.
    """

    def __init__(self, opt, options: OffloadOptions):
        self.opt, self.options = opt, options
        self.device = opt.device
        self.cuda = self.device.type == "cuda"
        self.pin = options.pin_memory
        self.segments: list[Segment] = list(opt.reducer.segments)
        self.early = options.early_step and not opt.max_grad_norm and opt.scaler is None and not opt.skip_nonfinite
        self.tp_skip = group_rank(opt.norm_groups.tp) != 0
        # bf16/fp16 copy-out targets on the host, one per flat group (stage 3 with offload_param:
        # the kernel writes the host parameter shards directly, so none for those segments).
        self.lowp: list[torch.Tensor | None] = []
        for g in opt.groups:
            needs = g.key.dtype != torch.float32 and any(self._device_dest(s) is not None for s in g.segments)
            self.lowp.append(host_empty(g.shard_numel, g.key.dtype, self.pin) if needs else None)
        init = {"initializer": torch.cuda.set_device, "initargs": (self.device,)} if self.cuda else {}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-offload", **init)
        self.futures: list[Future] = []
        if self.cuda:
            self.d2h, self.h2d = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        self._copied: dict[int, object] = {}  # worker only: id(seg) -> event of its last host->device copy
        self.order = forward_order(opt.module, self.segments)   # the order the worker steps them
        # GAS 1: every landing is a segment's whole final gradient, so its norm is taken on the device
        # (float64, fixed order) for every segment, whichever side steps it
        self.device_norms = opt.gradient_accumulation_steps == 1
        self.device_step = self._device_stepper(options.device_step_fraction, options.device_step_adaptive)
        self._cpu_start = self._cpu_end = None   # wall time of the last step's CPU share (worker)
        # With a device share the deferred mode is faster: the CPU and the device step their shares at
        # the same time. Measured on 1 x H200 (886M, no clipping, share 0.3): deferred 32.4k tokens/s;
        # early mode with the device share queued right after backward 27.7k (the CPU share stepped
        # during backward ran at ~2.4 instead of ~4.4 Gparams/s).
        self.early = self.early and self.device_step is None
        self.ready = Readiness(self.order, self.device, opt.dp_group, opt.dp_size, opt.allgather_bucket_size,
                               opt.overlap_comm)
        self._in_place = [s for s in self.segments if s.local is None]   # not stage-3 shards
        self._ran: set[int] = set()      # modules whose forward ran (module_needs)
        self._needs: dict[int, int] = {}
        self._needs_for = -1             # len(self._ran) when _needs was computed
        self._hooks = [m.register_forward_pre_hook(self._pre_forward, prepend=True) for m in opt.module.modules()]
        if opt.gatherer is not None:
            opt.gatherer.gate = self.ready
        self._reset()

    def _device_stepper(self, fraction: float, adaptive: bool) -> DeviceStepper | None:
        """The ``DeviceStepper`` for the first ``fraction`` of the partition in forward order (None at 0).

        Raises:
            ValueError: a fraction > 0 with Lion, GAS > 1, or no segment whose weights live on the device.
        """
        if fraction <= 0.0 and not adaptive:
            return None
        opt = self.opt
        problems = []
        if getattr(opt.optimizer, "kind", None) not in ("adam", "adamw"):
            problems.append(f"optimizer {getattr(opt.optimizer, 'kind', type(opt.optimizer).__name__)} (needs Adam/AdamW)")
        if opt.gradient_accumulation_steps != 1:
            problems.append(f"gradient_accumulation_steps={opt.gradient_accumulation_steps} (needs 1)")
        eligible = [s for s in self.order if self._device_dest(s) is not None]
        if not eligible:
            problems.append("no segment with device-resident weights (stage 3 with offload_param keeps them on the host)")
        if problems:
            raise ValueError("device_step_fraction > 0 cannot be used with " + "; ".join(problems) +
                             "; set it to 0")
        total, count, acc = sum(s.shard_size for s in self.order), 0, 0
        for s in eligible:
            if acc >= fraction * total:
                break
            count += 1
            acc += s.shard_size
        return DeviceStepper(self, eligible, count, adaptive)

    # ---- per-step state ---------------------------------------------------------------------------
    def _reset(self) -> None:
        self.finalized: set[int] = set()
        self.stepped: set[int] = set()
        self.sumsq: dict[int, float] = {}
        self.device_sq: dict[int, torch.Tensor] = {}  # id(seg) -> float64 device scalar (device_norms)
        self.used: dict[int, object] = {}  # id(seg) -> compute-stream event after backward's last use
        self.begun = False  # begin_step() called for this step (worker in early mode, else main thread)
        if getattr(self, "device_step", None) is not None:
            self.device_step.reset()

    def _submit(self, fn, *args) -> None:
        self.futures.append(self.worker.submit(fn, *args))

    def drain(self) -> None:
        """Wait for every queued landing/finalize task; re-raise the first error a task hit."""
        futures, self.futures = self.futures, []
        for f in futures:
            f.result()

    def synchronize(self) -> None:
        """Main thread: finish the overlapped step in flight (every segment stepped, copied back and,
        at dp > 1, all-gathered, in order; device-stepped states back in host memory). Collective over
        dp while a step is in flight."""
        self.ready.wait_all()
        if self.device_step is not None:
            self.device_step.wait()

    def _pre_forward(self, module, args) -> None:
        self._ran.add(id(module))
        if self.ready.active:
            k = self._needs.get(id(module))
            if k is not None:
                self.ready.through(k)

    # ---- landing (main thread, from GradReducer) --------------------------------------------------
    def land(self, seg: Segment, out: torch.Tensor | None, fresh: bool) -> None:
        """A reduced segment gradient ``out`` (``[S]``, reduce dtype, on the device; None: already
        packed into the host shard) is ready: start its copy to the host and queue its host work."""
        opt = self.opt
        self.synchronize()  # the last step's host work reads the gradient shards this overwrites
        last = opt.micro_steps + 1 >= opt.gradient_accumulation_steps or bool(opt.boundary_override)
        if self.device_norms:   # GAS 1: this is the segment's whole, final gradient
            grad = out if out is not None else self._grad(seg)   # None: packed in place (CPU-only, dp 1)
            self.device_sq[id(seg)] = (torch.zeros((), dtype=torch.float64, device=grad.device)
                                       if seg.key.tp_replicated and self.tp_skip
                                       else sum_squares64(grad, self._excluded(seg)))
            if self.device_step is not None and seg in self.device_step:
                self.device_step.land(seg, grad)
                self.finalized.add(id(seg))
                return
        host = self._grad(seg)
        src, event = out, None
        if out is not None and self.cuda:
            stream = self.d2h
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                if fresh and out.dtype == host.dtype:
                    host.copy_(out, non_blocking=True)
                    src = None
                else:
                    src = host_empty(out.numel(), out.dtype, self.pin)
                    src.copy_(out, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # the worker sleeps in synchronize()
                event.record(stream)
            out.record_stream(stream)
        used = None
        if last and self.cuda:
            used = torch.cuda.Event()
            used.record(torch.cuda.current_stream(self.device))
            self.used[id(seg)] = used
        if last:
            self.finalized.add(id(seg))
        self._submit(self._landed, seg, host, src, out, event, fresh, last, used)

    def _landed(self, seg, host, src, out, event, fresh, last, used) -> None:
        if event is not None:
            event.synchronize()
        del out  # the device buffer may be reused once the copy is done
        if src is not None:
            if fresh:
                host.copy_(src)
            else:
                host.add_(src)
        if last:
            self._finalize(seg, used)

    def _grad(self, seg: Segment) -> torch.Tensor:
        return self.opt.grad_shards[seg.group][seg.shard_offset:seg.shard_offset + seg.shard_size]

    def _finalize(self, seg: Segment, used=None) -> None:
        """Worker: norm partials of a segment's final gradient (and the early step)."""
        if not self.device_norms:   # GAS > 1: the final gradient exists only here, accumulated
            g = self._grad(seg)
            excluded = self._excluded(seg)
            total = sum_of_squares(g)
            counted = total - sum(sum_of_squares(g[a:b]) for a, b in excluded) if excluded else total
            self.sumsq[id(seg)] = 0.0 if seg.key.tp_replicated and self.tp_skip else counted
        if self.early:
            if not self.begun:
                self.opt.optimizer.begin_step()
                self.begun = True
            self._step_segment(seg, 1.0, used)
            self.stepped.add(id(seg))

    def _excluded(self, seg: Segment) -> list[tuple[int, int]]:
        exclude = self.opt.norm_exclude
        if not exclude:
            return []
        return [(pc.shard_offset - seg.shard_offset, pc.shard_offset - seg.shard_offset + pc.length)
                for pc in seg.pieces() if id(pc.slot.param) in exclude]

    # ---- the CPU step and the copy back (worker thread) -------------------------------------------
    def _device_dest(self, seg: Segment) -> torch.Tensor | None:
        """Where the updated compute-dtype shard of ``seg`` goes on the device (None: host shard)."""
        if seg.local is not None:
            return None if self.options.param else seg.local
        return seg.full[seg.lo:seg.lo + seg.shard_size]

    def _step_segment(self, seg: Segment, grad_coef: float, used=None):
        """Worker: host step of ``seg`` (gradient multiplied by ``grad_coef``) and its copy back to the
        device, queued on the h2d stream after ``used`` (backward's last read of the segment).
        Returns the event recorded after that copy (None without CUDA or device destination).
        Touches no per-step state of the pipeline: it may run after ``step()`` returned."""
        opt, host_opt = self.opt, self.opt.optimizer
        event = None
        previous = self._copied.pop(id(seg), None)
        if previous is not None:
            previous.synchronize()  # last step's copy out of the bf16 host buffer has finished
        gi, lo, n = seg.group, seg.shard_offset, seg.shard_size
        master, lowp = opt.masters[gi], self.lowp[gi]
        dest = self._device_dest(seg)
        if seg.key.dtype == torch.float32:
            out = None
        elif dest is None:
            out = seg.local            # offload_param: the host parameter shard itself
        else:
            out = lowp[lo:lo + n]
        host_opt.step_range(master, lo, n, opt.grad_shards[gi], lowp_out=out, grad_coef=grad_coef)
        self._cpu_end = time.perf_counter()
        src = master.detach()[lo:lo + n] if out is None else out
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
            self._copied[id(seg)] = event
        else:
            dest.copy_(src)
        return event

    # ---- the boundary (main thread) ---------------------------------------------------------------
    def step(self) -> bool:
        """Finish the optimizer step after every segment was reduced (see ``ZeroOptimizer.step``)."""
        opt = self.opt
        self.synchronize()
        last_split = None   # (CPU seconds, device seconds) of the previous step, for the adaptive split
        if self.device_step is not None and self._cpu_start is not None:
            cpu = self._cpu_end - self._cpu_start if self._cpu_end is not None else 0.0
            last_split = (max(cpu, 0.0), self.device_step.take_seconds())
        for seg in self.segments:
            if id(seg) not in self.finalized:
                self.finalized.add(id(seg))
                self._submit(self._finalize, seg)
        self.drain()
        groups = (opt.dp_group, opt.norm_groups.tp, opt.norm_groups.pp)
        device_sq = torch.stack(list(self.device_sq.values())).sum() if self.device_sq else None
        scale = opt.loss_scale
        total = torch.tensor([sum(self.sumsq[id(s)] for s in self.segments if id(s) in self.sumsq)],
                             dtype=torch.float64, device=self.device)
        if device_sq is not None:
            total = total + device_sq
        for group in groups:
            if group is not None and group_size(group) > 1:
                dist.all_reduce(total, group=group)
        norm = float(total.sqrt()) / scale
        if opt.must_skip(norm):   # inf/nan anywhere (fp16 overflow): the same decision on every rank
            self._reset()
            return opt.skip_step(norm)
        opt.grad_norm = norm
        coef = clip_coefficient(norm, opt.max_grad_norm) / scale
        if not (coef > 0 and math.isfinite(1.0 / coef)):
            raise FloatingPointError(f"gradient norm {norm} gives clip coefficient {coef}: the gradients are "
                                     "inf/nan; train with fp16 loss scaling or look for the source")
        if not self.begun:
            opt.optimizer.begin_step()   # main thread: reads the LR schedule's lr for this step
            self.begun = True
        tickets = []  # per segment in self.order: a Future of the copy-back event, or the event (early)
        self._cpu_start, self._cpu_end = time.perf_counter(), None
        for seg in self.order:
            if self.device_step is not None and seg in self.device_step:
                tickets.append(self.device_step.step(seg, coef))
            elif id(seg) in self.stepped:
                tickets.append(self._copied.get(id(seg)))   # the worker is idle (drained)
            else:
                tickets.append(self.worker.submit(self._step_segment, seg, coef, self.used.get(id(seg))))
        if self._needs_for != len(self._ran):
            self._needs = module_needs(opt.module, self._in_place, self.ready.pos, self._ran)
            self._needs_for = len(self._ran)
        self.ready.start(tickets)
        if last_split is not None:
            self.device_step.rebalance(*last_split)   # applies from the next backward on
        gathered_now = any(s.local is not None and s.full is not None for s in self.segments)
        if not self.options.overlap_step or gathered_now:  # inside gathered_parameters(): finish here
            self.synchronize()
        self._reset()
        opt.reducer.zero()
        if opt.scaler is not None:
            opt.scaler.update(False)
        opt.global_steps += 1
        return True

    def discard(self) -> None:
        """``zero_grad``: drop landed gradients. Early-mode steps already applied are completed."""
        self.synchronize()
        self.drain()
        if self.stepped:
            raise RuntimeError(f"{len(self.stepped)} of {len(self.segments)} gradient segments were already "
                               "stepped on the host (offload early mode, no clipping): call step() to finish "
                               "this step, or build the optimizer with OffloadOptions(early_step=False)")
        self._reset()

    def close(self) -> None:
        self.synchronize()
        self.drain()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.worker.shutdown(wait=True)
