"""Plain transformers with a ds_config's learning-rate schedule: the reference for scripts run with
``--deepspeed`` on a machine without the deepspeed package (``tests/test_hf_scripts.py``).

``from ds_reference import Trainer, TrainingArguments`` in place of transformers' import. ``--deepspeed``
is taken but DeepSpeed is not started: the run is transformers' own (its loop, data order, loss, DDP,
clipping, AdamW), except that the schedule is the one the ds_config's ``"scheduler"`` section names, as
DeepSpeed would step it. Only what the test configs use is served: AdamW with "auto" (or equal) values, and
``WarmupLR`` (DeepSpeed's: the lr starts at ``warmup_min_lr``; after ``n`` scheduler steps, ``t = n - 1``,
it is ``min + (max - min) * log(t + 1) / log(W)`` while ``t < W``, then ``max``; ``W = max(2,
warmup_num_steps)``; "auto" values filled as transformers fills them: ``min 0``, ``max learning_rate``,
``warmup_num_steps max(1, get_warmup_steps(max_steps))``). Anything else raises.

Written from DeepSpeed's documented semantics, independently of plait's schedulers.
"""

import json
import math
from dataclasses import dataclass, field

import torch
import transformers


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    ds_config: str = field(default=None, metadata={"help": "the ds_config (given as --deepspeed)"})

    def __post_init__(self):
        self.ds_config, self.deepspeed = self.deepspeed, None  # DeepSpeed itself is not started
        super().__post_init__()


class Trainer(transformers.Trainer):
    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is not None:
            return self.lr_scheduler
        with open(self.args.ds_config) as fh:
            config = json.load(fh)
        _check_optimizer(config.get("optimizer", {}), self.args)
        section = config.get("scheduler", {})
        if section.get("type") != "WarmupLR":
            raise ValueError(
                f"ds_reference serves the WarmupLR scheduler only, not {section.get('type')!r}"
            )
        params = section.get("params", {})

        def value(key, auto):
            return auto if params.get(key, "auto") == "auto" else params[key]

        lr = self.args.learning_rate
        low, high = value("warmup_min_lr", 0.0), value("warmup_max_lr", lr)
        steps = max(
            2, value("warmup_num_steps", max(1, self.args.get_warmup_steps(num_training_steps)))
        )
        if high != lr:
            raise ValueError(f"warmup_max_lr {high} differs from learning_rate {lr}")

        def factor(n):  # the lr after n scheduler steps, over the optimizer's lr (= warmup_max_lr)
            t = n - 1
            frac = 0.0 if t < 0 else (math.log(t + 1) / math.log(steps) if t < steps else 1.0)
            return (low + (high - low) * frac) / high

        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
        return self.lr_scheduler


def _check_optimizer(section: dict, args) -> None:
    """The config's optimizer must be the Trainer's own: AdamW with "auto" or the arguments' values, and
    no weight decay (the Trainer's AdamW exempts biases and norms from decay; DeepSpeed's decays all)."""
    if section.get("type", "AdamW") not in ("AdamW", "adamw"):
        raise ValueError(f"ds_reference serves AdamW only, not {section.get('type')!r}")
    params = section.get("params", {})
    ours = {
        "lr": args.learning_rate,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
    }
    for key, want in ours.items():
        got = params.get(key, "auto")
        if got != "auto" and got != want:
            raise ValueError(f"optimizer.params.{key} = {got!r} but the arguments give {want!r}")
    if args.weight_decay != 0.0:
        raise ValueError(
            "ds_reference needs weight_decay 0 (the Trainer's AdamW and DeepSpeed's differ on decay)"
        )
