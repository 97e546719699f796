"""What keeps a bad step from destroying a run, around the engine's training loop (``Engine`` holds one).

* Micro-batches: each is screened (``plait.engine.batch``); its verdict is read at the accumulation boundary,
  before the optimizer step, and agreed over every rank (one all-reduce of a flag per step; the texts are
  gathered only when some rank saw a bad one): a bad micro-batch on any rank drops the step's accumulation
  on every rank, and every rank raises the same error naming the rank(s) and the problem.
* Non-finite steps: ``ZeroOptimizer`` skips a step whose global gradient norm is inf/nan on every rank;
  here ``nonfinite_guard.max_consecutive_skips`` skips in a row end the run with ``NonFiniteError``,
  naming the step and the last applied step's loss: in fp32/bf16, and in fp16 where the loss scale
  cannot recover (a static ``fp16.loss_scale``, or a dynamic one already at ``fp16.min_loss_scale``).
* Hung ranks: after the first applied step the collectives time out after ``comm.timeout_s``; checkpoint
  I/O runs under ``comm.startup_timeout_s`` (``plait.parallel.launch.set_collective_timeout``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from plait.engine.batch import BatchLimits, check_micro_batch, screen_micro_batch
from plait.config import PlaitConfig
from plait.parallel.launch import set_collective_timeout
from plait.zero.precision import NonFiniteError


class RunGuard:
    """The engine's fault handling over one ``ZeroOptimizer`` (see the module docstring).

    Args:
        optimizer: the ``ZeroOptimizer`` (its gradients are dropped for a bad micro-batch; its skip
            counters and loss scaler are read). config: the resolved ``PlaitConfig`` (``nonfinite_guard``,
            ``comm``). groups: the process groups whose collective timeout is set (None entries skipped).
        limits: the model's ``plait.engine.batch.BatchLimits`` (vocabulary, positions).
        device: where the agreement's flag is all-reduced (the engine's device: a GPU under NCCL).
        pipelined: the engine runs a pipeline, whose micro-batches are agreed on when pulled
            (``agree``), so ``before_step`` has nothing to agree on.
    """

    def __init__(
        self,
        optimizer,
        config: PlaitConfig,
        groups,
        limits: BatchLimits,
        device: torch.device,
        pipelined: bool,
    ):
        self.optimizer, self.config, self.groups = optimizer, config, tuple(groups)
        self.limits, self.device, self.pipelined = limits, device, pipelined
        self.pending: list = []  # plait.engine.batch verdicts (Verdict, PendingCheck) of this step's micro-batches
        self.loss: torch.Tensor | None = (
            None  # the last micro-batch's loss (detached; no host sync)
        )
        self.last_applied: tuple[int, torch.Tensor | None] | None = None  # (global step, its loss)
        self.scale_before: float | None = None  # the fp16 loss scale the last step ran at

    def screen(self, batch: dict) -> dict:
        """The batch to compute with (``screen_micro_batch``). Raises TypeError/ValueError at once for a
        batch that cannot be computed, after dropping the step's accumulation (on this rank)."""
        try:
            batch, verdict = screen_micro_batch(batch, self.limits)
        except (TypeError, ValueError):
            self.drop_step()
            raise
        if verdict is not None:
            self.pending.append(verdict)
        return batch

    def before_step(self) -> None:
        """At the boundary: read this step's verdicts and agree on them over every rank (``agreed_error``); a
        bad micro-batch on any rank drops the step's accumulation on every rank and raises there."""
        pending, self.pending = self.pending, []
        scaler = self.optimizer.scaler
        self.scale_before = scaler.scale if scaler is not None else None
        if self.pipelined:
            return
        problems = [p for p in (v.problem() for v in pending) if p is not None]
        error = agreed_error(ValueError(problems[0]) if problems else None, self.device)
        if error is not None:
            self.drop_step()
            raise error

    def agree(self, problem: Exception | None) -> None:
        """Collective over every rank, for micro-batches checked before any computes (a pipeline's, an
        evaluation's): when any rank has a ``problem`` (its first bad micro-batch), raise on every rank the
        same error (``agreed_error``); nothing accumulated is dropped."""
        error = agreed_error(problem, self.device)
        if error is not None:
            raise error

    def pull(self, data_iter, n: int, step: int, check: bool) -> list[dict]:
        """The ``n`` (``gradient_accumulation_steps``) micro-batches of step ``step`` from ``data_iter``. With
        ``check`` each is checked (``plait.engine.batch.check_micro_batch``) and the verdict agreed over every
        rank (``agree``) before any computes.

        Raises:
            ValueError: the iterator ran out (naming how many of ``n`` it gave); a bad micro-batch on any rank.
        """
        it = data_iter if hasattr(data_iter, "__next__") else iter(data_iter)
        out, problem = [], None
        for i in range(n):
            try:
                batch = next(it)
            except StopIteration:
                raise ValueError(
                    f"the data iterator ran out after {i} of the {n} micro-batches of step "
                    f"{step} (gradient_accumulation_steps={n}); "
                    "give train_batch an iterator with enough batches (or one that cycles)"
                ) from None
            if check:
                try:
                    batch = check_micro_batch(batch, self.limits)
                except (TypeError, ValueError) as err:
                    problem = problem or err
            out.append(batch)
        if check:
            self.agree(problem)
        return out

    def after_step(self, applied: bool, global_steps: int) -> None:
        """After the optimizer step: end start-up (short timeout) or count towards the skip limit."""
        if not applied:
            self._check_skips()
            return
        if self.last_applied is None:  # start-up is over: from now on a hung rank is caught sooner
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
        stuck = self._stuck_scale()
        if zero.consecutive_skips < limit or (zero.scaler is not None and stuck is None):
            return  # below the limit, or a dynamic loss scale still falling: it recovers by itself
        step, loss = self.last_applied or (0, None)
        last = (
            f"the last applied step was {step}"
            + (f" (loss {float(loss):.6g})" if loss is not None else "")
            if step
            else "no step was applied yet"
        )
        raise NonFiniteError(
            f"{zero.consecutive_skips} optimizer steps in a row (up to step {zero.global_steps + zero.skipped_steps})"
            f" had an inf/nan global gradient norm and were skipped; {last}. "
            + (
                stuck
                or "Look for the source (the batches of those steps, the lr, a layer that overflows) and "
                "resume from the last checkpoint"
            )
            + f"; nonfinite_guard.max_consecutive_skips (now {limit}) sets how many skips in a row end the run"
        )

    def _stuck_scale(self) -> str | None:
        """Why the fp16 loss scale cannot end the skips (the fix to name), or None (no scaler, or a dynamic
        scale that was above its floor for the last step and is falling)."""
        scaler, scale = self.optimizer.scaler, self.scale_before
        if scaler is None or scale is None:
            return None
        if not scaler.dynamic:
            return (
                f"fp16 gradients overflow at the static loss scale {scale:g} (fp16.loss_scale), which never "
                "changes, so every step is skipped: set fp16.loss_scale to 0 (a dynamic scale, lowered on "
                "overflow), or a smaller static fp16.loss_scale, or train in bf16 (bf16.enabled: true)"
            )
        if scale <= scaler.min_loss_scale:
            return (
                f"fp16 gradients overflow at the dynamic loss scale's floor {scale:g} (fp16.min_loss_scale), "
                "below which it cannot fall: lower fp16.min_loss_scale, or train in bf16 (bf16.enabled: true), "
                "or look for the source of inf/nan (the lr, the batches)"
            )
        return None


def agreed_error(problem: Exception | None, device: torch.device) -> Exception | None:
    """The error every rank raises for this step's micro-batches, or None when no rank has a ``problem``.

    Collective over the world (every rank calls it once per step): one all-reduce of a flag ``[1]`` on
    ``device``; only when some rank has a problem are the messages gathered (``all_gather_object``). The
    returned error (the first bad rank's type, TypeError or ValueError) is the same on every rank and names
    the bad rank(s) with their problems. One process: ``problem`` itself.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    flag = torch.full((1,), int(problem is not None), dtype=torch.int32, device=device)
    dist.all_reduce(flag)
    if not int(flag.item()):
        return None
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        seen, None if problem is None else (type(problem).__name__, str(problem))
    )
    by_text: dict[tuple[str, str], list[int]] = {}
    for rank, entry in enumerate(seen):
        if entry is not None:
            by_text.setdefault(tuple(entry), []).append(rank)
    head = (
        f"a bad micro-batch on {_ranks(sorted(r for rs in by_text.values() for r in rs))} of {len(seen)} "
        "(every rank stops this step, nothing of it applied, and raises this error)"
    )
    if len(by_text) == 1:
        parts = [text for (_, text) in by_text]
    else:
        parts = [f"{_ranks(rs)}: {text}" for (_, text), rs in by_text.items()]
    kind = TypeError if next(iter(by_text))[0] == "TypeError" else ValueError
    return kind(f"{head}: " + "; ".join(parts))


def _ranks(ranks: list[int]) -> str:
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))
