"""Build the optimizer and learning-rate schedule a ds_config names, for the fp32 master shards.

DeepSpeed's ``optimizer.type`` values map to torch optimizers (or plait's LAMB):

=========  ==============================================================================
``Adam``   ``torch.optim.AdamW`` when ``adam_w_mode`` (DeepSpeed's default), else ``torch.optim.Adam``
``AdamW``  ``torch.optim.AdamW``
``SGD``    ``torch.optim.SGD``
``LAMB``   ``plait.optim.Lamb`` (per-tensor trust ratio, over ZeRO's shards via ``lamb_segments``)
=========  ==============================================================================

A user may instead pass a torch optimizer *class* or factory ``f(param_groups, **kw)``, or an
optimizer instance (its class and hyper-parameters are reused: ZeRO builds the real optimizer
over the master shards, so the instance's own state is not used).
"""

from __future__ import annotations

import inspect

import torch

from plait.config import ConfigError
from plait.optim.lamb import Lamb
from plait.optim.schedulers import SCHEDULERS


NO_OPTIMIZER = (
    "this engine was built without an optimizer (no 'optimizer' section in the config and none passed "
    'to initialize), for forward passes only; add "optimizer": {"type": "AdamW", "params": '
    '{"lr": ...}} or pass optimizer= to train'
)


class NoOptimizer(torch.optim.Optimizer):
    """The optimizer of an engine built without one (evaluation, inference, a frozen reference model), as
    DeepSpeed's ``initialize`` builds one when no optimizer is given: ZeRO shards and gathers the parameters as
    for training; nothing steps them.

    Raises:
        ConfigError: ``step`` (naming the missing optimizer and the fix).
    """

    def __init__(self, params, **_):
        super().__init__(params, {"lr": 0.0})

    def step(self, closure=None):
        raise ConfigError(NO_OPTIMIZER)


def optimizer_from_config(opt_cfg, device_type: str = "cpu"):
    """``(factory, kwargs)`` for ``ZeroOptimizer`` from a resolved ``OptimizerConfig``. Raises ConfigError
    for a type plait cannot build, and for no optimizer at all (a learning rate is never guessed)."""
    if opt_cfg is None:
        raise ConfigError(
            "the config has no 'optimizer' section and no optimizer was passed: add "
            '"optimizer": {"type": "AdamW", "params": {"lr": ...}} or pass optimizer= to initialize'
        )
    params = dict(opt_cfg.params)
    kind = opt_cfg.type.lower()
    fused = {"fused": True} if device_type == "cuda" else {}
    if kind in ("adam", "adamw"):
        if (
            params.pop("state_dtype", "fp32") != "fp32"
        ):  # served by HostOptimizer: plait.engine.offload
            raise ConfigError(
                "optimizer.params.state_dtype other than fp32 is built by plait.engine.offload."
                "engine_optimizer (the HostOptimizer kernels)"
            )
        if not params.pop("bias_correction", True):
            raise ConfigError(
                "optimizer.params.bias_correction = false is not supported by torch's Adam; "
                "remove it"
            )
        adamw = params.pop("adam_w_mode", True) or kind == "adamw"
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        return cls, {**params, "betas": tuple(params.get("betas", (0.9, 0.999))), **fused}
    if kind == "sgd":
        return torch.optim.SGD, params
    if kind == "lamb":
        return Lamb, {**params, "betas": tuple(params.get("betas", (0.9, 0.999)))}
    raise ConfigError(
        f"optimizer.type {opt_cfg.type!r} is not available in the engine; use Adam, AdamW, SGD "
        "or LAMB, or pass a torch optimizer class to plait.initialize(optimizer=...)"
    )


def _constructor_kwargs(cls, defaults: dict) -> dict:
    """The entries of an optimizer's ``defaults`` its constructor takes: torch's AdamW records
    ``decoupled_weight_decay`` in its defaults but does not accept it back."""
    takes = inspect.signature(cls.__init__).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in takes.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in takes}


def optimizer_from_user(optimizer):
    """``(factory, kwargs, param_groups_or_None)`` from what a user passed as ``optimizer``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [dict(g) for g in optimizer.param_groups]
        return type(optimizer), _constructor_kwargs(type(optimizer), optimizer.defaults), groups
    if callable(optimizer):
        return optimizer, {}, None
    raise TypeError(
        f"optimizer must be a torch optimizer, its class or a factory, got {type(optimizer).__name__}"
    )


def scheduler_from_config(sched_cfg, optimizer):
    """A DeepSpeed-style schedule over ``optimizer`` (the torch optimizer of the master shards), or None."""
    if sched_cfg is None:
        return None
    cls = SCHEDULERS.get(sched_cfg.type)
    if cls is None:
        raise ConfigError(f"scheduler.type {sched_cfg.type!r} is not one of {sorted(SCHEDULERS)}")
    return cls(optimizer, **sched_cfg.params)


def scheduler_from_user(lr_scheduler, optimizer):
    """A user's schedule: a factory ``f(optimizer) -> scheduler`` applied to the master-shard optimizer.

    Raises:
        TypeError: a scheduler *instance* (it is bound to another optimizer; pass a factory instead).
    """
    if lr_scheduler is None:
        return None
    if hasattr(lr_scheduler, "step") and hasattr(
        lr_scheduler, "optimizer"
    ):  # an instance, not a factory
        raise TypeError(
            "pass lr_scheduler as a factory, e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10): "
            "ZeRO steps its own optimizer over the master shards, so an instance bound to another "
            "optimizer would change nothing"
        )
    return lr_scheduler(optimizer)
