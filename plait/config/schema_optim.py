"""``optimizer`` and ``scheduler`` sections: the params dataclasses per ``type`` and their registries.

Part of the config schema (:mod:`plait.config.schema` re-exports every name here); field metadata as
described there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from plait.config.schema_base import ConfigError, _auto


def _check_hparams(params: Any) -> None:
    """Range checks of ``optimizer.params`` (values still "auto" are checked once filled in).

    Raises:
        ConfigError: naming the key, the value and the allowed range.
    """
    def bad(key: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(f"optimizer.params.{key} = {value!r} is out of range: it must be {allowed}")

    for key in ("lr", "eps", "weight_decay"):
        v = getattr(params, key, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not (math.isfinite(v) and v >= 0):
            raise bad(key, v, "a finite number >= 0")
    betas = getattr(params, "betas", None)
    if isinstance(betas, (tuple, list)) and not (len(betas) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
        raise bad("betas", list(betas), "two numbers in [0, 1), e.g. [0.9, 0.999]")


@dataclass(frozen=True)
class AdamParams:
    """``optimizer.params`` for Adam / AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019).

    As in DeepSpeed, ``"Adam"`` defaults to decoupled weight decay (``adam_w_mode=True``, i.e. AdamW);
    set ``adam_w_mode: false`` for L2-regularised Adam. ``"AdamW"`` requires ``adam_w_mode`` true.
    """

    lr: float = _auto(1e-3)
    betas: tuple[float, float] = _auto((0.9, 0.999))
    eps: float = _auto(1e-8)
    weight_decay: float = _auto(0.0)
    bias_correction: bool = True
    adam_w_mode: bool = True

    def __post_init__(self) -> None:
        _check_hparams(self)


@dataclass(frozen=True)
class LambParams:
    """``optimizer.params`` for LAMB (You et al. 2020, Alg. 2); the trust ratio is clamped to
    ``[min_coeff, max_coeff]`` as in DeepSpeed's FusedLamb."""

    lr: float = _auto(1e-3)
    betas: tuple[float, float] = _auto((0.9, 0.999))
    eps: float = _auto(1e-8)
    weight_decay: float = _auto(0.0)
    bias_correction: bool = True
    max_coeff: float = 10.0
    min_coeff: float = 0.01

    def __post_init__(self) -> None:
        _check_hparams(self)


@dataclass(frozen=True)
class SGDParams:
    """``optimizer.params`` for SGD with optional (Nesterov) momentum, torch.optim.SGD semantics."""

    lr: float = _auto(1e-3)
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = _auto(0.0)
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_hparams(self)


@dataclass(frozen=True)
class LionParams:
    """``optimizer.params`` for Lion (Chen et al. 2023, Alg. 2)."""

    lr: float = _auto(1e-4)
    betas: tuple[float, float] = _auto((0.9, 0.99))
    weight_decay: float = _auto(0.0)

    def __post_init__(self) -> None:
        _check_hparams(self)


@dataclass(frozen=True)
class WarmupLRParams:
    """``scheduler.params`` for WarmupLR: lr rises from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` steps (``warmup_type`` "log" or "linear"), then stays at ``warmup_max_lr``."""

    warmup_min_lr: float = _auto(0.0)
    warmup_max_lr: float = _auto(0.001)
    warmup_num_steps: int = _auto(1000)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


@dataclass(frozen=True)
class WarmupDecayLRParams(WarmupLRParams):
    """``scheduler.params`` for WarmupDecayLR: WarmupLR's, then linear decay to 0 at ``total_num_steps``."""

    total_num_steps: int = _auto(None)  # required


@dataclass(frozen=True)
class WarmupCosineLRParams:
    """``scheduler.params`` for WarmupCosineLR: the lr *ratio* (of the optimizer's lr) warms up from
    ``warmup_min_ratio`` to 1 over ``warmup_num_steps``, then follows a cosine down to ``cos_min_ratio`` at
    ``total_num_steps`` (Loshchilov & Hutter 2017, Eq. 5 without restarts)."""

    total_num_steps: int = _auto(None)  # required
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = _auto(1000)
    cos_min_ratio: float = 0.0001
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


#: Optimizer ``type`` (canonical spelling) -> its params dataclass. Matched case-insensitively.
OPTIMIZER_PARAMS = MappingProxyType({"Adam": AdamParams, "AdamW": AdamParams, "LAMB": LambParams,
                                     "SGD": SGDParams, "Lion": LionParams})
#: Scheduler ``type`` -> its params dataclass. Matched case-insensitively.
SCHEDULER_PARAMS = MappingProxyType({"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
                                     "WarmupCosineLR": WarmupCosineLRParams})
#: Params that must be given (or resolved from "auto") for a scheduler type.
REQUIRED_PARAMS = frozenset({"total_num_steps"})


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` is one of Adam, AdamW, LAMB, SGD, Lion; ``params`` holds every parameter of
    that optimizer with defaults filled in (see :class:`AdamParams` etc.), ``betas`` as a tuple."""

    type: str
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: ``type`` is one of WarmupLR, WarmupDecayLR, WarmupCosineLR; ``params`` uses
    DeepSpeed's names (warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, total_num_steps,
    cos_min_ratio, warmup_min_ratio) with defaults filled in. Steps count optimizer steps."""

    type: str
    params: dict = field(default_factory=dict)
