"""Reduced gradient segments on their way to the host (ZeRO-Offload, Ren et al., USENIX ATC'21, Sec. 4.2:
gradients are offloaded to the host as they are produced, overlapped with backward).

Per segment ``G`` (``[S]``, this rank's slice): the device->host copy runs on a side stream, the
worker thread copies or (GAS > 1) adds it into the host gradient shard, and once ``G`` is final its
squared norm is known: at GAS 1 on the device before the copy (``clip.sum_squares64``: float64, an
order fixed by the segment length, so the norm does not depend on which side steps ``G``), at
GAS > 1 on the host once accumulated (numba, float64). Only landings of the last micro-step
(``is_last_micro_step()`` during backward: ``micro_steps + 1 == GAS``; stage 1 reduces at the boundary)
are final; segments not yet final at ``step()`` are finalized there (``finalize_rest``). With
``final_at_step`` (``OffloadOptions``: the gradients change after backward, e.g. a pipeline's tied sum) no
landing is final and every norm is taken on the host at ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.kernels.lowp import sum_of_squares
from plait.parallel.collectives import group_rank
from plait.zero.clip import sum_squares64
from plait.zero.flat import Segment
from plait.zero.pinned import host_empty
from plait.zero.stepper import ShardSet


class Landing:
    """Takes reduced gradient segments to the host shard and keeps their squared norms.

    Args:
        shards: the ``ShardSet`` (host ``grad_shards``; ``norm_groups`` and ``norm_exclude`` of the norm).
        device: the module's device. pin: page-lock staging buffers.
        segments: every segment of the layout.
        share: the ``DeviceShare`` (segments it steps keep their gradient on the device), or None.
        submit: ``submit(fn, *args)`` queues work on the stepper's worker thread.
        synchronize: waits for the previous step still in flight (it reads the gradient shards).
        gradient_accumulation_steps: micro-steps per optimizer step (1: norms taken on the device).
        is_last_micro_step: main thread, during backward: whether this micro-step's gradients are final.
        on_final: worker: ``on_final(seg, used)`` once ``seg``'s gradient is final (early host step), or None.
        final_at_step: no landing is final (the caller edits the host gradients before ``step()``): every
            norm is computed by ``finalize_rest`` at ``step()``, on the host (no ``share`` then).
    """

    def __init__(
        self,
        shards: ShardSet,
        device: torch.device,
        pin: bool,
        segments: list[Segment],
        share,
        submit,
        synchronize,
        gradient_accumulation_steps: int,
        is_last_micro_step: Callable[[], bool],
        on_final=None,
        final_at_step: bool = False,
    ):
        self.shards, self.device, self.cuda, self.pin = shards, device, device.type == "cuda", pin
        self.segments, self.share, self.submit = segments, share, submit
        self.synchronize, self.is_last_micro_step, self.on_final = (
            synchronize,
            is_last_micro_step,
            on_final,
        )
        self.tp_skip = group_rank(shards.norm_groups.tp) != 0
        # GAS 1: every landing is a segment's whole final gradient, so its norm is taken on the device
        # (float64, fixed order) for every segment, whichever side steps it
        self.device_norms = gradient_accumulation_steps == 1 and not final_at_step
        self.final_at_step = final_at_step
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.reset()

    def reset(self) -> None:
        self.finalized: set[int] = set()
        self.sumsq: dict[int, float] = {}
        self.device_sq: dict[
            int, torch.Tensor
        ] = {}  # id(seg) -> float64 device scalar (device_norms)
        self.used: dict[
            int, object
        ] = {}  # id(seg) -> compute-stream event after backward's last use

    def land(self, seg: Segment, out: torch.Tensor | None, fresh: bool) -> None:
        """Main thread (``GradReducer``'s sink): a reduced segment gradient ``out`` (``[S]``, reduce dtype, on
        the device; None: already packed into the host shard) is ready: start its copy to the host and
        queue its host work. ``fresh``: first landing of this step (copy, not add)."""
        self.synchronize()  # the last step's host work reads the gradient shards this overwrites
        last = not self.final_at_step and self.is_last_micro_step()
        if not self.device_norms and self.share is not None and id(seg) in self.share.resident:
            grad = self.grad(
                seg
            )  # GAS > 1: accumulated in the resident group's device gradient shard
            if out is not None:
                grad.copy_(out) if fresh else grad.add_(out)
            if last:
                self.finish_resident(seg)
            return
        if self.device_norms:  # GAS 1: this is the segment's whole, final gradient
            grad = (
                out if out is not None else self.grad(seg)
            )  # None: packed in place (CPU-only, dp 1)
            self.device_sq[id(seg)] = self._device_norm(seg, grad)
            if self.share is not None and seg in self.share:
                self.share.land(seg, grad)
                self.finalized.add(id(seg))
                return
        host = self.grad(seg)
        src, event = out, None
        if out is not None and self.cuda:
            src, event = self._to_host(out, host, fresh)
        used = None
        if last and self.cuda:
            used = torch.cuda.Event()
            used.record(torch.cuda.current_stream(self.device))
            self.used[id(seg)] = used
        if last:
            self.finalized.add(id(seg))
        self.submit(self._landed, seg, host, src, out, event, fresh, last, used)

    def finish_resident(self, seg: Segment) -> None:
        """Main thread: the final gradient of a segment whose states live on the device (``placement``) is in
        its device gradient shard: its norm partial (on the device) and its hand-over to the ``DeviceShare``."""
        grad = self.grad(seg)
        self.device_sq[id(seg)] = self._device_norm(seg, grad)
        self.share.land(seg, grad)
        self.finalized.add(id(seg))

    def _device_norm(self, seg: Segment, grad: torch.Tensor) -> torch.Tensor:
        """float64 device scalar: the squared norm of ``seg``'s final gradient ``grad`` as counted in the global
        norm (0 on tp ranks > 0 for tp-replicated segments; ``norm_exclude`` ranges left out)."""
        if seg.key.tp_replicated and self.tp_skip:
            return torch.zeros((), dtype=torch.float64, device=grad.device)
        return sum_squares64(grad, self.excluded(seg))

    def _to_host(self, out: torch.Tensor, host: torch.Tensor, fresh: bool):
        """Queue the device->host copy of ``out`` on the side stream: straight into ``host`` when it is the
        first landing in the same dtype, else into a staging buffer. Returns (staging or None, event)."""
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
        return src, event

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
            self.finalize(seg, used)

    def grad(self, seg: Segment) -> torch.Tensor:
        """The gradient ``[S]`` of ``seg``: a view of its grad shard (host; device for a resident group)."""
        return self.shards.grad_shards[seg.group][
            seg.shard_offset : seg.shard_offset + seg.shard_size
        ]

    def finalize(self, seg: Segment, used=None) -> None:
        """Worker: norm partials of a segment's final gradient (and the early step)."""
        if not self.device_norms:  # GAS > 1: the final gradient exists only here, accumulated
            g = self.grad(seg)
            excluded = self.excluded(seg)
            total = sum_of_squares(g)
            counted = (
                total - sum(sum_of_squares(g[a:b]) for a, b in excluded) if excluded else total
            )
            self.sumsq[id(seg)] = 0.0 if seg.key.tp_replicated and self.tp_skip else counted
        if self.on_final is not None:
            self.on_final(seg, used)

    def finalize_rest(self) -> None:
        """Main thread, at ``step()``: queue ``finalize`` for every segment not final yet; their copies back to
        the device wait for an event recorded now on the compute stream (after every use of the step)."""
        used = None
        for seg in self.segments:
            if (
                id(seg) not in self.finalized
                and self.share is not None
                and id(seg) in self.share.resident
            ):
                self.finish_resident(seg)
            elif id(seg) not in self.finalized:
                if used is None and self.cuda:
                    used = torch.cuda.Event()
                    used.record(torch.cuda.current_stream(self.device))
                self.used.setdefault(id(seg), used)
                self.finalized.add(id(seg))
                self.submit(self.finalize, seg, used)

    def squares(self) -> torch.Tensor:
        """``[1]`` float64 on the device: this rank's sum of squared final gradients (after the worker
        drained). Not yet all-reduced."""
        device_sq = torch.stack(list(self.device_sq.values())).sum() if self.device_sq else None
        total = torch.tensor(
            [sum(self.sumsq[id(s)] for s in self.segments if id(s) in self.sumsq)],
            dtype=torch.float64,
            device=self.device,
        )
        if device_sq is not None:
            total = total + device_sq
        return total

    def excluded(self, seg: Segment) -> list[tuple[int, int]]:
        """``(start, end)`` ranges of ``seg``'s slice left out of the norm (``norm_exclude``: tied copies)."""
        exclude = self.shards.norm_exclude
        if not exclude:
            return []
        return [
            (pc.shard_offset - seg.shard_offset, pc.shard_offset - seg.shard_offset + pc.length)
            for pc in seg.pieces()
            if id(pc.slot.param) in exclude
        ]
