"""What ``accelerator.prepare`` does with the model, optimizer and schedule under a ``DeepSpeedPlugin``, as
accelerate's ``Accelerator._prepare_deepspeed`` does it (read in accelerate 1.3.0 and 1.15), with
``plait.initialize`` in ``deepspeed.initialize``'s place.

``fill_auto`` fills the ds_config's "auto" values through the plugin's own ``fill_match`` /
``deepspeed_config_process`` (micro-batch from the dataloaders, accumulation from the Accelerator, bucket
sizes from ``model.config.hidden_size``, lr and schedule from ``DummyOptim`` / ``DummyScheduler``);
``check_objects`` refuses a torch optimizer or schedule beside a config section for it (and a dummy
without one), as accelerate does; ``build`` makes the engine (``EngineOptimizer`` is the optimizer the
script holds). The fill table and the objects' rules: ``docs/config.md``.
"""

from __future__ import annotations

import copy
import logging
import math

import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils.deepspeed import (
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
    DummyOptim,
    DummyScheduler,
)
from torch.optim.lr_scheduler import LRScheduler

import plait
from plait.deepspeed.entry import scheduler_factory

log = logging.getLogger("plait")

HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


class EngineOptimizer(DeepSpeedOptimizerWrapper):
    """accelerate's wrapper of a DeepSpeed optimizer (``step``/``zero_grad`` do nothing: ``backward`` steps the
    engine) over the engine's optimizer; ``step_was_skipped`` is the engine's (a non-finite gradient norm)."""

    def __init__(self, engine):
        super().__init__(engine.optimizer)
        self.engine = engine

    @property
    def step_was_skipped(self) -> bool:
        return not self.engine.was_step_applied()


def micro_batch_size(plugin, loaders: list, split_batches: bool, num_processes: int) -> int | None:
    """The ``train_micro_batch_size_per_gpu`` accelerate fills, from the dataloaders given to ``prepare``.

    Raises:
        ValueError: the key is "auto" and no dataloader (or one without ``batch_size``) was given
            (accelerate's message).
    """
    if not plugin.is_auto("train_micro_batch_size_per_gpu"):
        return plugin.get_value("train_micro_batch_size_per_gpu")
    sizes = [dl.batch_size for dl in loaders if hasattr(dl, "batch_size")]
    if not loaders or any(bs is None for bs in sizes):
        raise ValueError(
            'train_micro_batch_size_per_gpu is "auto" in the ds_config: pass the training (or '
            "evaluation) dataloader, with an integer batch_size, to the same accelerator.prepare() "
            "call as the model, or set an integer train_micro_batch_size_per_gpu in the ds_config"
        )
    if split_batches:
        sizes = [bs // num_processes for bs in sizes]
    return min(sizes) if plugin.is_train_batch_min else max(sizes)


def check_objects(config: dict, optimizer, scheduler) -> None:
    """accelerate's rules for an optimizer / schedule given both in the script and in the ds_config.

    Raises:
        ValueError: naming the object and the config section (accelerate's conditions).
    """
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise ValueError(
                "the ds_config has an 'optimizer' section and the script passes a torch optimizer to "
                "prepare(); remove the section or pass accelerate.utils.DummyOptim"
            )
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise ValueError("DummyOptim needs an 'optimizer' section in the ds_config")
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise ValueError(
                "the ds_config has a 'scheduler' section and the script passes a schedule to "
                "prepare(); remove the section or pass accelerate.utils.DummyScheduler"
            )
        if (
            "scheduler" not in config
            and isinstance(scheduler, DummyScheduler)
            and scheduler.lr_scheduler_callable is None
        ):
            raise ValueError(
                "DummyScheduler needs a 'scheduler' section in the ds_config or lr_scheduler_callable"
            )
    if (
        isinstance(optimizer, DummyOptim)
        and scheduler is not None
        and not isinstance(scheduler, DummyScheduler)
    ):
        raise ValueError("with DummyOptim the schedule must be accelerate.utils.DummyScheduler")


def fill_auto(
    plugin, model, optimizer, scheduler, micro: int | None, num_processes: int, split_batches: bool
) -> None:
    """Fill the plugin's ds_config "auto" values as accelerate does (the table in ``docs/config.md``);
    ``gradient_accumulation_steps`` is filled before (``Accelerator.prepare``).

    Raises:
        ValueError: a hidden-size key is "auto" and the model has no ``config.hidden_size(s)``.
    """
    values = {
        "gradient_clipping": 1.0,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    }
    if micro is not None:
        values["train_micro_batch_size_per_gpu"] = micro
        values["train_batch_size"] = (
            micro * plugin.get_value("gradient_accumulation_steps") * num_processes
        )
    values.update(_bucket_values(plugin, model))
    if isinstance(optimizer, DummyOptim):
        values.update(
            {
                "optimizer.params.lr": optimizer.lr,
                "optimizer.params.weight_decay": optimizer.weight_decay,
            }
        )
    if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
        values.update(_scheduler_values(scheduler, num_processes, split_batches))
    plugin.deepspeed_config_process(must_match=False, **values)


def _bucket_values(plugin, model) -> dict:
    """The ZeRO bucket keys the plugin's config leaves "auto", from the model's hidden size h (``h*h``,
    ``int(0.9*h*h)``, ``10*h``). Raises ValueError: one is "auto" and the model has no hidden size."""
    auto = [k for k in HIDDEN_SIZE_KEYS if plugin.is_auto(k)]
    if not auto:
        return {}
    config = getattr(model, "config", None)
    hidden = (
        getattr(config, "hidden_size", None)
        or max(getattr(config, "hidden_sizes", None) or [0])
        or None
    )
    if hidden is None:
        raise ValueError(
            f'the ds_config\'s {auto} are "auto" but the model has no config.hidden_size: set them '
            "to integers in the ds_config"
        )
    return dict(zip(HIDDEN_SIZE_KEYS, (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)))


def _scheduler_values(scheduler: DummyScheduler, num_processes: int, split_batches: bool) -> dict:
    """``scheduler.params`` from a ``DummyScheduler`` without a callable, as accelerate fills them."""
    opt = scheduler.optimizer
    max_lr = (
        opt.defaults["lr"]
        if getattr(opt, "defaults", None) is not None
        else getattr(opt, "lr", None)
    )
    values = {
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": max_lr,
        "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),
    }
    if scheduler.total_num_steps is not None:
        values["scheduler.params.total_num_steps"] = (
            scheduler.total_num_steps
            if split_batches
            else math.ceil(scheduler.total_num_steps / num_processes)
        )
    return values


def engine_config(plugin_config: dict) -> dict:
    """The plugin's config as plait reads it: accelerate sets ``steps_per_print`` to infinity to silence
    DeepSpeed; plait's "never" is 0."""
    config = copy.deepcopy(plugin_config)
    if config.get("steps_per_print") == float("inf"):
        config["steps_per_print"] = 0
    return config


def build(
    model, config: dict, optimizer, scheduler, step_with_optimizer: bool, split_batches: bool
):
    """``(engine, optimizer wrapper or None, schedule wrapper or None)``: ``plait.initialize`` with the
    objects as accelerate passes them to ``deepspeed.initialize`` (see the module docstring)."""
    kwargs = {}
    if isinstance(optimizer, DummyOptim):
        kwargs["model_parameters"] = optimizer.params
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
            kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
    elif isinstance(optimizer, torch.optim.Optimizer):
        kwargs["optimizer"] = optimizer
    engine = plait.initialize(model, engine_config(config), **kwargs)
    wrapped = EngineOptimizer(engine) if optimizer is not None else None
    if scheduler is None:
        return engine, wrapped, None
    if engine.lr_scheduler is not None:
        return engine, wrapped, DeepSpeedSchedulerWrapper(engine.lr_scheduler, wrapped)
    if not isinstance(scheduler, LRScheduler) or not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"prepare() got a schedule ({type(scheduler).__name__}) that plait cannot move onto the "
            "engine's optimizer: pass a torch LRScheduler built on the torch optimizer passed with it"
        )
    scheduler_factory(scheduler, optimizer)(
        engine.optimizer.optimizer
    )  # now drives the engine's optimizer
    return (
        engine,
        wrapped,
        AcceleratedScheduler(
            scheduler, wrapped, step_with_optimizer=step_with_optimizer, split_batches=split_batches
        ),
    )
