"""``HostStepper``: the ``ZeroOptimizer`` stepper of ZeRO-Offload (the optimizer steps on the host).

Ren et al., "ZeRO-Offload", USENIX ATC'21, Sec. 4: gradients land on the host during backward
(``plait.zero.offload.landing``), the CPU optimizer steps each segment (``copyback``) and the updated
compute-dtype shards go back to the device, overlapped with the next forward (``ready``). The
``ZeroOptimizer.step`` protocol calls ``grad_norm`` then ``apply`` or ``discard``; modes in
``plait.zero.offload``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from plait.parallel.collectives import group_size
from plait.zero.offload.copyback import CopyBack
from plait.zero.offload.device_share import DeviceShare
from plait.zero.offload.landing import Landing
from plait.zero.offload.options import OffloadOptions
from plait.zero.offload.ready import Readiness, module_needs
from plait.zero.stepper import ShardSet


class HostStepper:
    """Steps the host fp32 masters of a ``ZeroOptimizer`` with ``offload.optimizer`` (see the package).

    Args:
        shards: the ``ShardSet``: host masters and grad shards, the ``HostOptimizer``, the norm's groups.
        options: the ``OffloadOptions``.
        ready: the ``Readiness`` the next forward consumes updated segments from (also the stage-3
            gatherer's gate); its ``order`` is the order the worker steps segments in.
        module: the model (forward pre-hooks consume the updated segments).
        device: the module's device. dp_group: the data-parallel group the norm is summed over.
        gradient_accumulation_steps: micro-steps per optimizer step.
        steps_as_is: every step applies the gradients times exactly 1 and none is skipped (no clipping, no
            loss scale, ``skip_nonfinite`` off: ``ZeroOptimizer.step``), so a segment may be stepped as
            soon as its gradient is final (early mode, see the package).
        is_last_micro_step: main thread, during backward: whether this micro-step's gradients are final.

    Raises:
        ValueError: ``device_step_fraction`` > 0 or "auto" where it cannot apply (``_device_share``).
    """

    def __init__(
        self,
        shards: ShardSet,
        options: OffloadOptions,
        ready: Readiness,
        *,
        module: torch.nn.Module,
        device: torch.device,
        dp_group,
        gradient_accumulation_steps: int,
        steps_as_is: bool,
        is_last_micro_step: Callable[[], bool],
    ):
        self.shards, self.options, self.ready = shards, options, ready
        self.module, self.device, self.dp_group = module, device, dp_group
        self.segments = shards.segments
        self.order = ready.order
        self.writer = CopyBack(shards, device, options.param, options.pin_memory)
        init = (
            {"initializer": torch.cuda.set_device, "initargs": (device,)}
            if device.type == "cuda"
            else {}
        )
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-offload", **init)
        self.futures: list[Future] = []
        self.share = self._device_share(options.device_step_fraction, gradient_accumulation_steps)
        # early mode needs a clip coefficient of exactly 1 and no device share (deferred is then faster:
        # the CPU and the device step their shares at the same time)
        self.early = (
            options.overlap_step
            and steps_as_is
            and self.share is None
            and not options.final_at_step
        )
        self.landing = Landing(
            shards,
            device,
            options.pin_memory,
            self.segments,
            self.share,
            self._submit,
            self.synchronize,
            gradient_accumulation_steps,
            is_last_micro_step,
            self._early_step if self.early else None,
            final_at_step=options.final_at_step,
        )
        self.land = self.landing.land  # GradReducer's sink
        self._cpu_start = self._last_split = None  # timing of the CPU share (adaptive split)
        self._in_place = [s for s in self.segments if s.local is None]  # not stage-3 shards
        self._ran: set[int] = set()  # modules whose forward ran (module_needs)
        self._needs: dict[int, int] = {}
        self._needs_for = -1  # len(self._ran) when _needs was computed
        self._hooks = [
            m.register_forward_pre_hook(self._pre_forward, prepend=True) for m in module.modules()
        ]
        self._reset()

    def _share_problems(self, resident: list, gas: int) -> list[str]:
        """What keeps states from stepping on the device (named for the error texts); empty when nothing does."""
        optimizer, problems = self.shards.optimizer, []
        if getattr(optimizer, "kind", None) not in ("adam", "adamw"):
            problems.append(
                f"optimizer {getattr(optimizer, 'kind', type(optimizer).__name__)} (needs Adam/AdamW)"
            )
        if (
            gas != 1 and not resident
        ):  # a resident group accumulates on the device; a streamed share cannot
            problems.append(f"gradient_accumulation_steps={gas} (needs 1)")
        if self.options.final_at_step:
            problems.append(
                "gradients final only at step() (final_at_step: a pipeline edits them after backward, "
                "and a device share keeps its gradients where that edit does not reach)"
            )
        if any(self.writer.dest(s) is None for s in resident):
            problems.append(
                "offload_param (the weights of a resident group must live on the device)"
            )
        if not any(self.writer.dest(s) is not None for s in self.order):
            problems.append(
                "no segment with device-resident weights (stage 3 with offload_param keeps them on the "
                "host)"
            )
        return problems

    def _device_share(self, fraction, gas: int) -> DeviceShare | None:
        """The ``DeviceShare``: the segments whose states the placement keeps on the device
        (``OffloadOptions.ratio`` < 1), and of the others the first ``fraction`` of the partition in forward
        order, adaptive for "auto"; None (default): "auto" on a CUDA device where the step allows it and
        ``pin_memory`` is on (and the host states could be page-locked), else no share.

        Raises:
            ValueError: a fraction > 0 or "auto" with Lion, GAS > 1, ``final_at_step``, or no segment whose
                weights live on the device; a ratio < 1 with Lion, ``final_at_step`` or ``offload_param``.
        """
        by_default = fraction is None
        resident = [s for s in self.order if self.shards.groups[s.group].key.resident]
        # the default streams page-locked host states: only where the config lets plait page-lock (pin_memory)
        adaptive = fraction == "auto" or (
            by_default and self.device.type == "cuda" and self.options.pin_memory
        )
        if not adaptive and not fraction and not resident:
            return None
        if gas != 1 and resident and not by_default and (adaptive or fraction):
            raise ValueError(
                f"device_step_fraction {fraction!r} needs gradient_accumulation_steps=1 (got {gas}); set "
                "it to 0 (offload_optimizer.ratio < 1 keeps its states on the device at any accumulation)"
            )
        problems = self._share_problems(resident, gas)
        eligible = [s for s in self.order if self.writer.dest(s) is not None]
        if problems and resident:
            raise ValueError(
                f"offload_optimizer.ratio={self.options.ratio} (optimizer states on the device) cannot "
                "be used with " + "; ".join(problems) + "; set the ratio to 1"
            )
        if not problems and not self._streams_moments(fraction, by_default):
            adaptive, fraction = False, 0
            if not resident:
                return None
        if problems and by_default:
            return None
        if problems:
            what = "device_step_fraction 'auto'" if adaptive else "device_step_fraction > 0"
            raise ValueError(f"{what} cannot be used with " + "; ".join(problems) + "; set it to 0")
        adaptive = (
            adaptive and gas == 1
        )  # by default with a resident group at GAS > 1: no streamed share
        eligible, count, total = streamed_prefix(self.order, eligible, resident, fraction, adaptive)
        try:
            return DeviceShare(
                self.shards,
                self.device,
                self.writer.dest,
                eligible,
                count,
                total,
                adaptive,
                resident,
            )
        except (
            RuntimeError
        ):  # page-locking refused (pinned.pin_existing): the default steps on the CPU
            if not by_default:
                raise
            return None

    def _streams_moments(self, fraction, by_default: bool) -> bool:
        """Whether a streamed device share may copy the optimizer's moments: fp32 ones only (bf16/int8 moments,
        ``optimizer.params.state_dtype``, step on the host or, resident, on the device).

        Raises:
            ValueError: a fraction > 0 or "auto" set with bf16/int8 moments (naming both keys).
        """
        state_dtype = getattr(self.shards.optimizer, "state_dtype", "fp32")
        if state_dtype == "fp32":
            return True
        if fraction == "auto" or (fraction and not by_default):
            raise ValueError(
                f"device_step_fraction {fraction!r} streams fp32 moments; with optimizer.params.state_dtype "
                f"= {state_dtype!r} set it to 0 (offload_optimizer.ratio < 1 keeps states on the device "
                "in any state_dtype)"
            )
        return False

    def _reset(self) -> None:
        self.landing.reset()
        self.stepped: set[int] = set()
        self.begun = (
            False  # begin_step() called for this step (worker in early mode, else main thread)
        )
        if self.share is not None:
            self.share.reset()

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
        if self.share is not None:
            self.share.wait()

    def _pre_forward(self, module, args) -> None:
        self._ran.add(id(module))
        if self.ready.active:
            k = self._needs.get(id(module))
            if k is not None:
                self.ready.through(k)

    def _early_step(self, seg, used) -> None:
        """Worker, early mode: step ``seg`` as soon as its gradient is final (coefficient 1)."""
        if not self.begun:
            self.shards.optimizer.begin_step()
            self.begun = True
        self.writer.step_segment(seg, 1.0, used)
        self.stepped.add(id(seg))

    # ---- the Stepper protocol (main thread) -------------------------------------------------------
    def grad_norm(self) -> float:
        """Global L2 norm of the (loss-scaled) final gradients over dp x tp x pp, in float64 partials;
        inf/nan when any element is. Waits for every landing. Collective."""
        self.synchronize()
        self._last_split = (
            None  # (CPU seconds, device seconds) of the previous step, for the adaptive split
        )
        if self.share is not None and self._cpu_start is not None:
            cpu = self.writer.cpu_end - self._cpu_start if self.writer.cpu_end is not None else 0.0
            self._last_split = (max(cpu, 0.0), self.share.take_seconds())
        self.landing.finalize_rest()
        self.drain()
        total = self.landing.squares()
        for group in (self.dp_group, self.shards.norm_groups.tp, self.shards.norm_groups.pp):
            if group is not None and group_size(group) > 1:
                dist.all_reduce(total, group=group)
        return float(total.sqrt())

    def apply(self, coef: float) -> None:
        """Queue the host step of every segment in forward order (gradients times ``coef``) and hand
        the updated shards to the next forward (``Readiness``); waits only without ``overlap_step``."""
        if not self.begun:
            self.shards.optimizer.begin_step()  # main thread: reads the LR schedule's lr for this step
            self.begun = True
        tickets = []  # per segment in self.order: a Future of the copy-back event, or the event (early)
        self._cpu_start, self.writer.cpu_end = time.perf_counter(), None
        for seg in self.order:
            if self.share is not None and seg in self.share:
                tickets.append(self.share.step(seg, coef))
            elif id(seg) in self.stepped:
                tickets.append(self.writer.copied.get(id(seg)))  # the worker is idle (drained)
            else:
                tickets.append(
                    self.worker.submit(
                        self.writer.step_segment, seg, coef, self.landing.used.get(id(seg))
                    )
                )
        if self._needs_for != len(self._ran):
            self._needs = module_needs(self.module, self._in_place, self.ready.pos, self._ran)
            self._needs_for = len(self._ran)
        self.ready.start(tickets)
        if self._last_split is not None:
            self.share.rebalance(*self._last_split)  # applies from the next backward on
        gathered_now = any(s.local is not None and s.full is not None for s in self.segments)
        if (
            not self.options.overlap_step or gathered_now
        ):  # inside gathered_parameters(): finish here
            self.synchronize()
        self._reset()

    def discard(self) -> None:
        """Drop landed gradients (a skipped step, ``zero_grad``). Early-mode steps already applied are not
        undone: that raises."""
        self.synchronize()
        self.drain()
        if self.stepped:
            raise RuntimeError(
                f"{len(self.stepped)} of {len(self.segments)} gradient segments were already "
                "stepped on the host (offload early mode, no clipping): call step() to finish "
                "this step, or build the optimizer with OffloadOptions(overlap_step=False)"
            )
        self._reset()

    def close(self) -> None:
        self.synchronize()
        self.drain()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.worker.shutdown(wait=True)


def streamed_prefix(order: list, eligible: list, resident: list, fraction, adaptive: bool):
    """Of the segments not kept ``resident``: the ``eligible`` ones (weights on the device), how many of them
    from the first stream their states for a step of ``fraction`` of the partition in forward ``order`` (0
    when ``adaptive``: the share grows as it measures), and the partition's elements ``total``."""
    on_device = {id(s) for s in resident}
    eligible = [s for s in eligible if id(s) not in on_device]
    total = sum(s.shard_size for s in order if id(s) not in on_device)
    count, acc = 0, 0
    for s in eligible:
        if adaptive or acc >= (fraction or 0) * total:
            break
        count += 1
        acc += s.shard_size
    return eligible, count, total
