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
    all-gather updated shards (dp > 1) ; device waits on [h2d]

Exactness of clipping and fp16 overflow (``step_mode``): every segment's squared gradient norm and
non-finite flag are computed on the host as it lands (overlapped with backward), so at ``step()`` the
global norm costs one scalar all-reduce. The CPU step of a segment needs the clip coefficient
``min(1, max_norm / norm) / loss_scale``, known only once *every* segment has landed. Hence:

* **early** (``max_grad_norm`` off and no fp16 loss scaler, so the coefficient is exactly 1): each
  segment is stepped by the worker as soon as it lands, while backward computes earlier layers, and its
  bf16 copy-back is queued right away. This is the full overlap of the ZeRO-Offload paper.
* **deferred** (clipping on, or fp16): the segments' CPU steps start at ``step()`` with the exact
  coefficient (no speculation, no use of a stale norm), in forward order, each followed at once by
  its non-blocking host->device copy, so copies overlap the next segment's CPU step; the device->host
  copies, the gradient accumulation and the norm partials already overlapped backward. fp16 overflow
  skips the step before any state is touched.

Results equal the non-offloaded ``ZeroOptimizer`` to float32 rounding (the kernels match torch's
Adam/AdamW to ~1e-7; the norm is summed in another order), which ``tests/test_offload.py`` checks to
1e-6 relative.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.parallel.collectives import group_rank, group_size
from plait.zero.clip import clip_coefficient
from plait.zero.flat import Segment, gather_segments
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
    """

    optimizer: bool = True
    param: bool = False
    pin_memory: bool = True
    num_threads: int | None = None
    early_step: bool = True


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """``[numel]`` host tensor, page-locked when ``pin`` and CUDA is available."""
    return torch.empty(numel, dtype=dtype, pin_memory=bool(pin and torch.cuda.is_available()))


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = host_empty(t.numel(), t.dtype, pin)
    out.copy_(t.reshape(-1))
    return out


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
        self.early = options.early_step and not opt.max_grad_norm and opt.scaler is None
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
        self._copied: dict[int, object] = {}  # id(seg) -> event of its last host->device copy
        self._reset()

    # ---- per-step state ---------------------------------------------------------------------------
    def _reset(self) -> None:
        self.finalized: set[int] = set()
        self.stepped: set[int] = set()
        self.sumsq: dict[int, float] = {}
        self.nonfinite: dict[int, bool] = {}
        self.used: dict[int, object] = {}  # id(seg) -> compute-stream event after backward's last use
        self.begun = False

    def _submit(self, fn, *args) -> None:
        self.futures.append(self.worker.submit(fn, *args))

    def drain(self) -> None:
        """Wait for every queued host task; re-raise the first error a task hit."""
        futures, self.futures = self.futures, []
        for f in futures:
            f.result()

    # ---- landing (main thread, from GradReducer) --------------------------------------------------
    def land(self, seg: Segment, out: torch.Tensor | None, fresh: bool) -> None:
        """A reduced segment gradient ``out`` (``[S]``, reduce dtype, on the device; None: already
        packed into the host shard) is ready: start its copy to the host and queue its host work."""
        opt = self.opt
        last = opt.micro_steps + 1 >= opt.gradient_accumulation_steps
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
        if last and self.cuda:
            used = torch.cuda.Event()
            used.record(torch.cuda.current_stream(self.device))
            self.used[id(seg)] = used
        if last:
            self.finalized.add(id(seg))
        self._submit(self._landed, seg, host, src, out, event, fresh, last)

    def _landed(self, seg, host, src, out, event, fresh, last) -> None:
        if event is not None:
            event.synchronize()
        del out  # the device buffer may be reused once the copy is done
        if src is not None:
            if fresh:
                host.copy_(src)
            else:
                host.add_(src)
        if last:
            self._finalize(seg)

    def _grad(self, seg: Segment) -> torch.Tensor:
        return self.opt.grad_shards[seg.group][seg.shard_offset:seg.shard_offset + seg.shard_size]

    def _finalize(self, seg: Segment) -> None:
        """Worker: norm partials of a segment's final gradient (and the early step)."""
        g = self._grad(seg)
        excluded = self._excluded(seg)
        total = float(torch.dot(g, g))
        counted = total - sum(float(torch.dot(g[a:b], g[a:b])) for a, b in excluded) if excluded else total
        self.nonfinite[id(seg)] = not math.isfinite(total)
        self.sumsq[id(seg)] = 0.0 if seg.key.tp_replicated and self.tp_skip else counted
        if self.early:
            self._step_segment(seg, 1.0)

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

    def _step_segment(self, seg: Segment, grad_scale: float) -> None:
        opt, host_opt = self.opt, self.opt.optimizer
        if not self.begun:
            host_opt.begin_step()
            self.begun = True
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
        host_opt.step_range(master, lo, n, opt.grad_shards[gi], lowp_out=out, grad_scale=grad_scale)
        src = master.detach()[lo:lo + n] if out is None else out
        if dest is None:
            if out is None:
                seg.local.copy_(src)
        elif self.cuda:
            with torch.cuda.stream(self.h2d):
                used = self.used.get(id(seg))
                if used is not None:
                    self.h2d.wait_event(used)
                dest.copy_(src, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # the worker sleeps in synchronize()
                event.record(self.h2d)
            self._copied[id(seg)] = event
        else:
            dest.copy_(src)
        self.stepped.add(id(seg))

    # ---- the boundary (main thread) ---------------------------------------------------------------
    def step(self) -> bool:
        """Finish the optimizer step after every segment was reduced (see ``ZeroOptimizer.step``)."""
        opt = self.opt
        for seg in self.segments:
            if id(seg) not in self.finalized:
                self.finalized.add(id(seg))
                self._submit(self._finalize, seg)
        self.drain()
        groups = (opt.dp_group, opt.norm_groups.tp, opt.norm_groups.pp)
        if opt.scaler is not None and _any_across(any(self.nonfinite.values()), groups, self.device):
            self._reset()
            opt.reducer.zero()
            opt.grad_norm = None
            opt.skipped_steps += 1
            opt.scaler.update(True)
            return False
        scale = opt.loss_scale
        total = torch.tensor([sum(self.sumsq[id(s)] for s in self.segments)], dtype=torch.float32,
                             device=self.device)
        for group in groups:
            if group is not None and group_size(group) > 1:
                dist.all_reduce(total, group=group)
        norm = float(total.sqrt()) / scale
        opt.grad_norm = norm
        coef = clip_coefficient(norm, opt.max_grad_norm) / scale
        if not (coef > 0 and math.isfinite(1.0 / coef)):
            raise FloatingPointError(f"gradient norm {norm} gives clip coefficient {coef}: the gradients are "
                                     "inf/nan; train with fp16 loss scaling or look for the source")
        order = self.segments if opt.stage == 3 else list(reversed(self.segments))  # forward order
        for seg in order:
            if id(seg) not in self.stepped:
                self._submit(self._step_segment, seg, 1.0 / coef)
        self.drain()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)
        self._gather_updated()
        self._reset()
        opt.reducer.zero()
        if opt.scaler is not None:
            opt.scaler.update(False)
        opt.global_steps += 1
        return True

    def _gather_updated(self) -> None:
        """All-gather the updated shards into whole parameters where dp ranks hold them whole."""
        outs, ins = [], []
        for seg in self.segments:
            if seg.local is not None:
                if seg.full is not None:
                    outs.append(seg.full)
                    ins.append(seg.local.to(self.device))
            elif seg.world > 1:
                outs.append(seg.full)
                ins.append(seg.full[seg.lo:seg.lo + seg.shard_size].clone())
        for pending, _ in gather_segments(outs, ins, self.opt.dp_group, self.opt.dp_size,
                                          self.opt.allgather_bucket_size, async_op=self.opt.overlap_comm):
            pending.wait()

    def discard(self) -> None:
        """``zero_grad``: drop landed gradients. Early-mode steps already applied are completed."""
        self.drain()
        if self.stepped:
            raise RuntimeError(f"{len(self.stepped)} of {len(self.segments)} gradient segments were already "
                               "stepped on the host (offload early mode, no clipping): call step() to finish "
                               "this step, or build the optimizer with OffloadOptions(early_step=False)")
        self._reset()

    def close(self) -> None:
        self.drain()
        self.worker.shutdown(wait=True)


def _any_across(flag: bool, groups, device) -> bool:
    """True when ``flag`` is set on any rank of ``groups`` (all-reduce MAX). Collective."""
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=device)
    for group in groups:
        if group is not None and group_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)
