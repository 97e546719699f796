"""``zero_optimization`` section and its ``offload_optimizer`` / ``offload_param`` subsections.

Part of the config schema (:mod:`plait.config.schema` re-exports every name here); field metadata as
described there.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Literal

from plait.config.schema_base import AUTO, ConfigError, _auto, bounded


@dataclass(frozen=True)
class OffloadConfig:
    """``offload_optimizer`` / ``offload_param``: ``device`` "none" or "cpu" (ZeRO-Offload, Ren et al. 2021);
    ``pin_memory`` allocates the host buffers page-locked for faster device copies.
    ``device_step_fraction`` (plait; ``offload_optimizer`` only): the share, in [0, 1), of the optimizer
    partition whose update the device computes from the host-resident states while the CPU steps the
    rest (``plait.zero.offload.device_share``; Adam/AdamW, GAS 1); 0 keeps the whole step on the CPU.
    ``"auto"`` (``OffloadOptions(device_step_fraction="auto")``) moves the split each step towards equal CPU
    and device times; this "auto" is the value itself, not a placeholder that ``plait.config.resolve`` or
    the Hugging Face Trainer fills. Left out (None): "auto" where the model is on a GPU and the step allows
    a device share, else 0.
    ``ratio`` (DeepSpeed's; ``offload_optimizer`` only): the share, in [0, 1], of the optimizer states
    (fp32 masters and moments) kept in host memory; the rest stay on the GPU and are stepped there
    (``plait.zero.offload.placement``; Adam/AdamW, weights on the GPU). 1 (default): all on the host.
    ``"auto"`` (plait): the smallest share (in steps of 0.05) whose planned GPU peak fits the GPU's measured
    free memory (``plait.fit.check.fit_config``, at engine build); like ``device_step_fraction``'s "auto",
    the value itself, not a placeholder the resolver fills.
    ``device_step_adaptive: true``: the deprecated spelling of ``device_step_fraction: "auto"`` (a warning;
    refused together with a fraction other than 0); read into ``device_step_fraction``, then None.

    Raises:
        ConfigError: ``device_step_fraction`` neither None, "auto" nor in [0, 1); ``device_step_adaptive`` with
            a fraction; ``ratio`` not a number in [0, 1].
    """

    device: Literal["none", "cpu"] = "none"
    pin_memory: bool = False
    device_step_fraction: float | Literal["auto"] | None = None
    device_step_adaptive: bool | None = None
    ratio: float | Literal["auto"] = 1.0

    def __post_init__(self) -> None:
        r = self.ratio
        number = (
            isinstance(r, (int, float))
            and not isinstance(r, bool)
            and math.isfinite(r)
            and 0.0 <= r <= 1.0
        )
        if r != AUTO and not number:
            raise ConfigError(
                f"offload_optimizer.ratio = {r!r} must be a number in [0, 1] (the share of the optimizer "
                'states in host memory; 1: all of them, as DeepSpeed\'s default) or "auto"'
            )
        fraction, adaptive = self.device_step_fraction, self.device_step_adaptive
        if adaptive is not None:
            if adaptive and fraction not in (None, 0, AUTO):
                raise ConfigError(
                    f"offload_optimizer.device_step_adaptive starts the device share at 0 and moves it "
                    f"each step; it does not take device_step_fraction={fraction}: remove one of them"
                )
            logging.getLogger("plait").warning(
                'config: offload_optimizer.device_step_adaptive is deprecated; write "device_step_fraction": '
                '"auto" instead (adaptive split) or leave it out'
            )
            object.__setattr__(self, "device_step_fraction", AUTO if adaptive else fraction)
            object.__setattr__(self, "device_step_adaptive", None)
        fraction = self.device_step_fraction
        if fraction not in (None, AUTO) and not (
            isinstance(fraction, (int, float))
            and not isinstance(fraction, bool)
            and math.isfinite(fraction)
            and 0.0 <= fraction < 1.0
        ):
            raise ConfigError(
                f'offload_optimizer.device_step_fraction = {fraction!r} must be "auto" or a number '
                "in [0, 1) (the share of the optimizer step the device computes; 0: all on the CPU)"
            )

    @property
    def enabled(self) -> bool:
        """True when tensors live on the host (``device == "cpu"``)."""
        return self.device == "cpu"


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization`` (Rajbhandari et al. SC'20). ``stage`` 0: plain data parallel; 1: optimizer
    states partitioned over dp; 2: + gradients; 3: + parameters. Bucket sizes and thresholds count
    *elements* (parameters), not bytes, as in DeepSpeed. ``reshard_after_forward`` (plait; stage 3, FSDP2's
    option of that name): release each unit's gathered parameters when its forward ends and gather them again
    for its backward (default), or keep them from forward to backward (one all-gather per micro-step instead of
    two, more memory)."""

    stage: int = 0
    allgather_partitions: bool = True
    allgather_bucket_size: int = bounded(500_000_000, ge=0)
    overlap_comm: bool | None = None  # None: True for stage 3, else False (DeepSpeed's default)
    reduce_scatter: bool = True
    reduce_bucket_size: int = bounded(500_000_000, ge=0, auto=True)
    contiguous_gradients: bool = True
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    sub_group_size: int = bounded(1_000_000_000, ge=0)
    stage3_prefetch_bucket_size: int = bounded(
        50_000_000, ge=0, auto=True, aliases=("prefetch_bucket_size",)
    )
    stage3_param_persistence_threshold: int = bounded(
        100_000, ge=0, auto=True, aliases=("param_persistence_threshold",)
    )
    stage3_max_live_parameters: int = bounded(
        1_000_000_000, ge=0, auto=True, aliases=("max_live_parameters",)
    )
    stage3_max_reuse_distance: int = bounded(
        1_000_000_000, ge=0, auto=True, aliases=("max_reuse_distance",)
    )
    stage3_gather_16bit_weights_on_model_save: bool = _auto(
        False,
        aliases=("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"),
    )
    ignore_unused_parameters: bool = True
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {self.stage}")
        if (
            self.offload_param.enabled and self.stage != 3
        ):  # DeepSpeed reads offload_param at stage 3 only
            logging.getLogger("plait").warning(
                "config: zero_optimization.offload_param is accepted and not used: parameters are offloaded "
                "at stage 3 only (stage %d here), as in DeepSpeed",
                self.stage,
            )
            object.__setattr__(self, "offload_param", OffloadConfig())
        if self.offload_param.ratio != 1:
            raise ConfigError(
                f"zero_optimization.offload_param.ratio = {self.offload_param.ratio} is not a key of "
                "offload_param; the share of optimizer states on the host is offload_optimizer.ratio"
            )
        if self.offload_optimizer.enabled and self.stage == 0:
            raise ConfigError(
                "zero_optimization.offload_optimizer needs stage 1, 2 or 3 (the host holds one "
                'dp rank\'s partition of the optimizer states); set "stage" to 1, 2 or 3'
            )

    @property
    def gathers_16bit_on_save(self) -> bool:
        """Whether ``save_16bit_model`` gathers the whole model: not under ZeRO-3 with
        ``stage3_gather_16bit_weights_on_model_save`` false (DeepSpeed's rule)."""
        return self.stage < 3 or self.stage3_gather_16bit_weights_on_model_save
