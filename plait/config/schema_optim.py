"""``optimizer`` and ``scheduler`` sections: the params dataclasses per ``type`` and their registries.

Part of the config schema (:mod:`plait.config.schema` re-exports every name here); field metadata as
described there. Ranges follow DeepSpeed's meaning of each key (``deepspeed.runtime.lr_schedules``): warm-up
steps >= 1, a decay that ends no earlier than the warm-up, ratios in [0, 1], learning rates >= 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from plait.config.schema_base import ConfigError, bounded


@dataclass(frozen=True)
class AdamParams:
    """``optimizer.params`` for Adam / AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019).

    As in DeepSpeed, ``"Adam"`` defaults to decoupled weight decay (``adam_w_mode=True``, i.e. AdamW);
    set ``adam_w_mode: false`` for L2-regularised Adam. ``"AdamW"`` requires ``adam_w_mode`` true.

    ``state_dtype`` (plait's key; DeepSpeed has none) stores the two moments in ``"fp32"`` (default, 8 bytes per
    parameter), ``"bf16"`` (4) or ``"int8"`` (8-bit block-wise quantization, bitsandbytes'/torchao's AdamW8bit
    scheme: 2.03); the fp32 master weights stay. It sits beside the other Adam hyper-parameters because it
    belongs to the optimizer wherever its states live (offloaded or not, ``plait.kernels.quant``).
    """

    lr: float = bounded(1e-3, ge=0, auto=True)
    betas: tuple[float, float] = bounded((0.9, 0.999), ge=0, lt=1, auto=True)
    eps: float = bounded(1e-8, ge=0, auto=True)
    weight_decay: float = bounded(0.0, ge=0, auto=True)
    bias_correction: bool = True
    adam_w_mode: bool = True
    state_dtype: Literal["fp32", "bf16", "int8"] = "fp32"


@dataclass(frozen=True)
class LambParams:
    """``optimizer.params`` for LAMB (You et al. 2020, Alg. 2); the trust ratio is clamped to
    ``[min_coeff, max_coeff]`` as in DeepSpeed's FusedLamb."""

    lr: float = bounded(1e-3, ge=0, auto=True)
    betas: tuple[float, float] = bounded((0.9, 0.999), ge=0, lt=1, auto=True)
    eps: float = bounded(1e-8, ge=0, auto=True)
    weight_decay: float = bounded(0.0, ge=0, auto=True)
    bias_correction: bool = True
    max_coeff: float = bounded(10.0, ge=0)
    min_coeff: float = bounded(0.01, ge=0)

    def __post_init__(self) -> None:
        if self.min_coeff > self.max_coeff:
            raise ConfigError(
                f"optimizer.params.min_coeff = {self.min_coeff!r} is above optimizer.params.max_coeff = "
                f"{self.max_coeff!r}: the trust ratio is clamped to [min_coeff, max_coeff]; make "
                "min_coeff <= max_coeff (DeepSpeed's defaults: 0.01 and 10)"
            )


@dataclass(frozen=True)
class SGDParams:
    """``optimizer.params`` for SGD with optional (Nesterov) momentum, torch.optim.SGD semantics."""

    lr: float = bounded(1e-3, ge=0, auto=True)
    momentum: float = bounded(0.0, ge=0)
    dampening: float = 0.0
    weight_decay: float = bounded(0.0, ge=0, auto=True)
    nesterov: bool = False

    def __post_init__(self) -> None:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(
                f"optimizer.params.nesterov = true needs momentum > 0 and dampening 0, got momentum "
                f"{self.momentum!r} and dampening {self.dampening!r}; set them or nesterov false"
            )


@dataclass(frozen=True)
class LionParams:
    """``optimizer.params`` for Lion (Chen et al. 2023, Alg. 2)."""

    lr: float = bounded(1e-4, ge=0, auto=True)
    betas: tuple[float, float] = bounded((0.9, 0.99), ge=0, lt=1, auto=True)
    weight_decay: float = bounded(0.0, ge=0, auto=True)


def _check_decay(params: Any, floor: str) -> None:
    """A decay must end no earlier than the warm-up: with ``total_num_steps`` below ``warmup_num_steps`` the lr
    never reaches its peak and drops to the ``floor`` at the end of the warm-up (DeepSpeed only warns).

    Raises:
        ConfigError: naming both keys, both values and the fix.
    """
    total, warmup = params.total_num_steps, params.warmup_num_steps
    if isinstance(total, int) and isinstance(warmup, int) and total < warmup:
        raise ConfigError(
            f"scheduler.params.total_num_steps = {total} is below scheduler.params.warmup_num_steps "
            f"= {warmup}: the lr would never reach its peak and would drop to {floor} after step "
            f"{warmup}; set total_num_steps to the run's length in optimizer steps (>= "
            "warmup_num_steps) or lower warmup_num_steps"
        )


@dataclass(frozen=True)
class WarmupLRParams:
    """``scheduler.params`` for WarmupLR: lr rises from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` steps (``warmup_type`` "log" or "linear"), then stays at ``warmup_max_lr``.

    Raises:
        ConfigError: ``warmup_min_lr`` above ``warmup_max_lr`` (the warm-up would lower the lr).
    """

    warmup_min_lr: float = bounded(0.0, ge=0, auto=True)
    warmup_max_lr: float = bounded(0.001, ge=0, auto=True)
    warmup_num_steps: int = bounded(1000, ge=1, auto=True)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = bounded(-1, ge=-1)

    def __post_init__(self) -> None:
        lo, hi = self.warmup_min_lr, self.warmup_max_lr
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > hi:
            raise ConfigError(
                f"scheduler.params.warmup_min_lr = {lo!r} is above scheduler.params.warmup_max_lr = "
                f"{hi!r}: the warm-up would lower the lr; make warmup_min_lr <= warmup_max_lr"
            )


@dataclass(frozen=True)
class WarmupDecayLRParams(WarmupLRParams):
    """``scheduler.params`` for WarmupDecayLR: WarmupLR's, then linear decay to ``warmup_min_lr`` at
    ``total_num_steps`` (>= ``warmup_num_steps``; ConfigError otherwise)."""

    total_num_steps: int = bounded(None, ge=1, auto=True)  # required

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_decay(self, "warmup_min_lr")


@dataclass(frozen=True)
class WarmupCosineLRParams:
    """``scheduler.params`` for WarmupCosineLR: the lr *ratio* (of the optimizer's lr) warms up from
    ``warmup_min_ratio`` to 1 over ``warmup_num_steps``, then follows a cosine down to ``cos_min_ratio`` at
    ``total_num_steps`` (>= ``warmup_num_steps``; ConfigError otherwise) (Loshchilov & Hutter 2017, Eq. 5
    without restarts). Both ratios lie in [0, 1]."""

    total_num_steps: int = bounded(None, ge=1, auto=True)  # required
    warmup_min_ratio: float = bounded(0.0, ge=0, le=1)
    warmup_num_steps: int = bounded(1000, ge=1, auto=True)
    cos_min_ratio: float = bounded(0.0001, ge=0, le=1)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = bounded(-1, ge=-1)

    def __post_init__(self) -> None:
        _check_decay(self, "cos_min_ratio x lr")


#: Optimizer ``type`` (canonical spelling) -> its params dataclass. Matched case-insensitively.
OPTIMIZER_PARAMS = MappingProxyType(
    {
        "Adam": AdamParams,
        "AdamW": AdamParams,
        "LAMB": LambParams,
        "SGD": SGDParams,
        "Lion": LionParams,
    }
)
#: Scheduler ``type`` -> its params dataclass. Matched case-insensitively.
SCHEDULER_PARAMS = MappingProxyType(
    {
        "WarmupLR": WarmupLRParams,
        "WarmupDecayLR": WarmupDecayLRParams,
        "WarmupCosineLR": WarmupCosineLRParams,
    }
)
#: Params that must be given (or resolved from "auto") for a scheduler type.
REQUIRED_PARAMS = frozenset({"total_num_steps"})


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` is one of Adam, AdamW, LAMB, SGD, Lion; ``params`` holds every parameter of
    that optimizer with defaults filled in (see :class:`AdamParams` etc.), ``betas`` as a tuple."""

    type: str
    params: dict = field(default_factory=dict)


def state_dtype_of(optimizer: OptimizerConfig | None, bf16) -> str:
    """How the optimizer stores Adam's moments: ``optimizer.params.state_dtype``, or "bf16" for DeepSpeed's
    ``bf16.bf16_optimizer_states: true`` (its Adam moments in bf16, DeepSpeed PR 7700); "fp32" by default.

    Raises:
        ConfigError: ``bf16_optimizer_states`` without ``bf16.enabled``, with an optimizer other than Adam/AdamW,
            or beside a different ``optimizer.params.state_dtype`` (naming both keys).
    """
    named = optimizer.params.get("state_dtype", "fp32") if optimizer is not None else "fp32"
    if not getattr(bf16, "bf16_optimizer_states", False):
        return named
    if not bf16.enabled:
        raise ConfigError(
            "bf16.bf16_optimizer_states = true needs bf16.enabled = true; enable bf16 or remove it"
        )
    if optimizer is None or optimizer.type not in ("Adam", "AdamW"):
        raise ConfigError(
            "bf16.bf16_optimizer_states = true stores Adam/AdamW moments in bf16; the optimizer is "
            f"{optimizer.type if optimizer is not None else 'none'}: use Adam/AdamW or remove it"
        )
    if named not in ("fp32", "bf16"):
        raise ConfigError(
            f"bf16.bf16_optimizer_states = true asks for bf16 moments but optimizer.params.state_dtype "
            f"= {named!r}; keep one of the two keys"
        )
    return "bf16"


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: ``type`` is one of WarmupLR, WarmupDecayLR, WarmupCosineLR; ``params`` uses
    DeepSpeed's names (warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, total_num_steps,
    cos_min_ratio, warmup_min_ratio) with defaults filled in. Steps count optimizer steps."""

    type: str
    params: dict = field(default_factory=dict)
