"""What keeps a bad step from destroying a run, around the engine's training loop (``Engine`` holds one).

* Micro-batches: each is screened (``plait.batch``); a batch already on a GPU is read back at the
  accumulation boundary, before the optimizer step. A bad one drops the step's accumulation and raises.
* Non-finite steps: ``ZeroOptimizer`` skips a step whose global gradient norm is inf/nan on every rank;
  here ``nonfinite_guard.max_consecutive_skips`` skips in a row end the run with ``NonFiniteError``,
  naming the step and the last applied step's loss.
* Hung ranks: after the first applied step the collectives time out after ``comm.timeout_s``; checkpoint
  I/O runs under ``comm.startup_timeout_s`` (``plait.parallel.launch.set_collective_timeout``).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from plait.batch import screen_micro_batch
from plait.config import PlaitConfig
from plait.parallel.launch import set_collective_timeout
from plait.zero.precision import NonFiniteError


class RunGuard:
    """The engine's fault handling over one ``ZeroOptimizer`` (see the module docstring).

    Args:
        optimizer: the ``ZeroOptimizer`` (its gradients are dropped for a bad micro-batch; its skip
            counters are read). config: the resolved ``PlaitConfig`` (``nonfinite_guard``, ``comm``).
        groups: the process groups whose collective timeout is set (None entries skipped).
        vocab_size: the model's vocabulary size (None: token ids are only type-checked).
    """

    def __init__(self, optimizer, config: PlaitConfig, groups, vocab_size: int | None):
        self.optimizer, self.config, self.groups, self.vocab_size = optimizer, config, tuple(groups), vocab_size
        self.pending: list = []   # plait.batch.PendingCheck of this step's device micro-batches
        self.loss: torch.Tensor | None = None   # the last micro-batch's loss (detached; no host sync)
        self.last_applied: tuple[int, torch.Tensor | None] | None = None   # (global step, its loss)

    def screen(self, batch: dict) -> dict:
        """The batch to compute with (``screen_micro_batch``). Raises TypeError/ValueError for a bad
        one, after dropping the step's accumulation."""
        try:
            batch, pending = screen_micro_batch(batch, self.vocab_size)
        except (TypeError, ValueError):
            self.drop_step()
            raise
        if pending is not None:
            self.pending.append(pending)
        return batch

    def before_step(self) -> None:
        """At the boundary: read this step's pending checks; a bad micro-batch drops the step and raises."""
        pending, self.pending = self.pending, []
        try:
            for check in pending:
                check.resolve()
        except ValueError:
            self.drop_step()
            raise

    def after_step(self, applied: bool, global_steps: int) -> None:
        """After the optimizer step: end start-up (short timeout) or count towards the skip limit."""
        if not applied:
            self._check_skips()
            return
        if self.last_applied is None:   # start-up is over: from now on a hung rank is caught sooner
            set_collective_timeout(self.config.comm.timeout_s, self.groups)
        self.last_applied = (global_steps, self.loss)

    def drop_step(self) -> None:
        """Discard the accumulation in progress: gradients, micro-step count, pending checks."""
        self.pending = []
        self.optimizer.zero_grad()

    @contextmanager
    def startup_timeout(self):
        """Run the body (checkpoint I/O: a rank may write for minutes) under ``comm.startup_timeout_s``."""
        set_collective_timeout(self.config.comm.startup_timeout_s, self.groups)
        try:
            yield
        finally:
            if self.last_applied is not None:
                set_collective_timeout(self.config.comm.timeout_s, self.groups)

    def _check_skips(self) -> None:
        zero, limit = self.optimizer, self.config.nonfinite_guard.max_consecutive_skips
        if zero.scaler is not None or zero.consecutive_skips < limit:
            return
        step, loss = self.last_applied or (0, None)
        last = (f"the last applied step was {step}" + (f" (loss {float(loss):.6g})" if loss is not None else "")
                if step else "no step was applied yet")
        raise NonFiniteError(
            f"{zero.consecutive_skips} optimizer steps in a row (up to step {zero.global_steps + zero.skipped_steps})"
            f" had an inf/nan global gradient norm and were skipped; {last}. Look for the source (the batches of "
            f"those steps, the lr, a layer that overflows) and resume from the last checkpoint; "
            f"nonfinite_guard.max_consecutive_skips (now {limit}) sets how many skips in a row end the run")
