"""Pieces of ``plait.hf.Trainer``'s loop: the window of step losses between logs, a batch sampler that skips
the micro-batches a resumed run already trained, and the steps and ``TrainerState`` of a run, as transformers
counts them."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import BatchSampler
from transformers.trainer_callback import TrainerState

#: transformers before 5.0 logs the step loss rounded to 4 decimals (``_maybe_log_save_evaluate``)
ROUNDS_LOGGED_LOSS = int(transformers.__version__.split(".")[0]) < 5


@dataclass
class LossWindow:
    """The step losses since the last logged step, summed on the device: one host synchronization (and one
    all-reduce over dp) per logged window, none per micro-batch."""

    sum: torch.Tensor
    logged_at: int
    total: float = 0.0
    started_at: int = -1

    def __post_init__(self):
        self.started_at = self.logged_at

    def drain(self, engine, step: int) -> float:
        """The mean step loss of the window ending at ``step`` (over dp ranks); the window restarts."""
        summed = float(engine.dp_mean(self.sum))
        self.total += summed
        mean = summed / max(step - self.logged_at, 1)
        mean = round(mean, 4) if ROUNDS_LOGGED_LOSS else mean
        self.sum.zero_()
        self.logged_at = step
        return mean


@dataclass
class Skip:
    """A batch sampler without its first ``skip`` batches (their indices are drawn, nothing is read)."""

    batches: BatchSampler
    skip: int

    def __iter__(self):
        return itertools.islice(iter(self.batches), self.skip, None)

    def __len__(self):
        return max(len(self.batches) - self.skip, 0)


def is_datasets_dataset(data) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(data, datasets.Dataset)


def steps_of(value: float, max_steps: int) -> int:
    """transformers' rule: a value below 1 is a fraction of ``max_steps``."""
    return math.ceil(max_steps * value) if value is not None and value < 1 else int(value or 0)


def plan_steps(args, examples: int, dp: int) -> tuple[int, int, int]:
    """(max_steps, epochs, optimizer steps per epoch) as transformers counts them, from the micro-batches
    each of ``dp`` ranks' loaders yields over ``examples`` examples."""
    per_rank = math.ceil(examples / dp)  # DistributedSampler pads to equal parts
    b = args.per_device_train_batch_size
    micro_batches = per_rank // b if args.dataloader_drop_last else math.ceil(per_rank / b)
    updates_per_epoch = max(math.ceil(micro_batches / args.gradient_accumulation_steps), 1)
    if args.max_steps > 0:
        epochs = math.ceil(args.max_steps / updates_per_epoch)
        return args.max_steps, epochs, updates_per_epoch
    epochs = math.ceil(args.num_train_epochs)
    return math.ceil(args.num_train_epochs * updates_per_epoch), epochs, updates_per_epoch


def new_state(args, max_steps: int, epochs: int) -> TrainerState:
    state = TrainerState()
    state.max_steps, state.num_train_epochs = max_steps, epochs
    state.logging_steps = steps_of(args.logging_steps, max_steps)
    state.eval_steps = (
        steps_of(args.eval_steps, max_steps) if args.eval_steps is not None else state.logging_steps
    )
    state.save_steps = steps_of(args.save_steps, max_steps)
    state.train_batch_size = args.per_device_train_batch_size
    state.is_local_process_zero = state.is_world_process_zero = (
        not dist.is_initialized() or dist.get_rank() == 0
    )
    return state
