"""What the engine reports as it trains, under DeepSpeed's config keys and formats:

* ``steps_per_print``: every that many optimizer steps, global rank 0 prints
  ``step=N, skipped=S, lr=[...], mom=[...]`` (skipped steps counted in N, as DeepSpeed counts them);
* ``wall_clock_breakdown``: forward, backward and optimizer-step wall time in milliseconds, summed over
  the same window, printed after that line as ``time (ms) | forward: ... | backward: ... | step: ...``
  (each timed region ends with a device synchronization, so the times are the device's too);
* monitors (``csv_monitor``, ``tensorboard``, ``wandb``; ``plait.engine.monitor``): after every optimizer step the
  events ``Train/Samples/train_loss`` (the step's mean micro-batch loss on rank 0), ``Train/Samples/lr``
  (the first param group's) and, with fp16, ``Train/Samples/loss_scale``; with ``wall_clock_breakdown`` also
  ``Train/Samples/elapsed_time_ms_{forward,backward,step}``; each at the step's number of samples trained.

Lines go to the ``plait`` logger at INFO when logging is configured, otherwise to standard output.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from plait.engine.monitor import Monitor

log = logging.getLogger("plait")

PARTS = ("forward", "backward", "step")


def emit(line: str) -> None:
    """``line`` to the ``plait`` logger when a handler would show it, else to standard output."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(line)
    else:
        print(line, flush=True)


class StepReport:
    """The engine's progress lines, timings and monitor events (see the module docstring).

    Args:
        steps_per_print: print every that many optimizer steps (0 or less: never).
        wall_clock_breakdown: time forward, backward and step. rank: this process's global rank (only
        rank 0 prints and writes). device: the compute device (synchronized around timed regions).
        gradient_accumulation_steps: micro-batches per step (a step's loss is their mean).
        monitors: from ``plait.engine.monitor.build_monitors``.
    """

    def __init__(
        self,
        steps_per_print: int,
        wall_clock_breakdown: bool,
        rank: int,
        device: torch.device,
        gradient_accumulation_steps: int,
        monitors: list[Monitor],
    ):
        self.steps_per_print, self.breakdown, self.rank = (
            steps_per_print,
            wall_clock_breakdown,
            rank,
        )
        self.device, self.gas, self.monitors = device, gradient_accumulation_steps, monitors
        self.window = dict.fromkeys(PARTS, 0.0)  # ms since the last printed line
        self.last = dict.fromkeys(PARTS, 0.0)  # ms of the step in progress
        self.step_loss: torch.Tensor | None = None

    @contextmanager
    def timed(self, part: str):
        """Time the body as ``part`` (one of PARTS) when ``wall_clock_breakdown`` is on."""
        if not self.breakdown:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.last[part] += 1e3 * (time.perf_counter() - start)

    def add_micro_loss(self, loss: torch.Tensor) -> None:
        """Count one micro-batch's loss towards the step's mean (kept on the device until the step ends)."""
        if self.monitors:
            part = loss.detach().float() / self.gas
            self.step_loss = part if self.step_loss is None else self.step_loss + part

    def set_step_loss(self, loss) -> None:
        """The step's mean loss as a whole (a pipeline's ``train_batch``)."""
        if self.monitors:
            self.step_loss = torch.as_tensor(loss).detach().float()

    def after_step(
        self,
        *,
        global_steps: int,
        global_samples: int,
        skipped_steps: int,
        lrs: list,
        moms: list,
        loss_scale: float | None,
    ) -> None:
        """Report the step that just ended (applied or skipped): monitor events, then the printed lines."""
        if self.monitors and self.rank == 0:
            events = [("Train/Samples/lr", float(lrs[0]), global_samples)]
            if self.step_loss is not None:
                events.insert(
                    0, ("Train/Samples/train_loss", float(self.step_loss), global_samples)
                )
            if loss_scale is not None:
                events.append(("Train/Samples/loss_scale", float(loss_scale), global_samples))
            if self.breakdown:
                events += [
                    (f"Train/Samples/elapsed_time_ms_{p}", self.last[p], global_samples)
                    for p in PARTS
                ]
            for monitor in self.monitors:
                monitor.write_events(events)
        self.step_loss = None
        for p in PARTS:
            self.window[p] += self.last[p]
            self.last[p] = 0.0
        if self.steps_per_print <= 0 or global_steps % self.steps_per_print != 0:
            return
        if self.rank == 0:
            emit(f"step={global_steps}, skipped={skipped_steps}, lr={lrs}, mom={moms}")
            if self.breakdown:
                emit("time (ms) | " + " | ".join(f"{p}: {self.window[p]:.2f}" for p in PARTS))
        self.window = dict.fromkeys(PARTS, 0.0)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
