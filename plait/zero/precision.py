"""Mixed precision for ZeRO: dtype names, fp16 loss scaling and the cross-rank overflow check.

Model parameters compute in fp32, bf16 or fp16; the optimizer steps fp32 master weights
(Micikevicius et al., "Mixed Precision Training", ICLR 2018, Sec. 3.1). fp16 gradients need the
loss scaled up so small values survive (ibid. Sec. 3.2); ``LossScaler`` follows DeepSpeed's
``fp16`` config semantics (``loss_scale``, ``initial_scale_power``, ``loss_scale_window``,
``hysteresis``, ``min_loss_scale``) so a DeepSpeed config means the same here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.dtypes import dtype_from_name


def resolve_dtype(value) -> torch.dtype:
    """A torch floating dtype from a dtype or a name ("fp32", "bf16", "fp16", "float16", ...;
    the names are :data:`plait.dtypes.DTYPE_NAMES`).

    Raises:
        ValueError: unknown name or a non-floating dtype; the message lists the accepted names.
    """
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(
                f"dtype {value} is not a floating dtype plait trains in; "
                "use torch.float32, torch.bfloat16 or torch.float16"
            )
        return value
    return dtype_from_name(value)


class LossScaleError(FloatingPointError):
    """Gradients still overflow at the minimum loss scale: training cannot make progress."""


class NonFiniteError(FloatingPointError):
    """Too many optimizer steps in a row had an inf/nan gradient norm and were skipped."""


def log_skipped_step(step: int, norm: float, in_a_row: int) -> None:
    """Log (rank 0, logger ``plait``) that optimizer step ``step`` (1-based, applied and skipped counted)
    was skipped for the non-finite global gradient norm ``norm``, the ``in_a_row``-th skip in a row."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logging.getLogger("plait").warning(
            "optimizer step %d skipped on every rank: global gradient norm is %s (%d in a row); the weights are "
            "those of the step before",
            step,
            norm,
            in_a_row,
        )


@dataclass
class LossScaler:
    """Static or dynamic loss scale for fp16 training (DeepSpeed ``fp16`` block semantics).

    Args:
        loss_scale: 0 for dynamic scaling; any positive value is a static scale that never changes.
        initial_scale_power: dynamic scaling starts at ``2**initial_scale_power``.
        loss_scale_window: after this many consecutive steps without overflow the scale doubles.
        hysteresis: overflows tolerated (step skipped, scale kept) before the scale is halved;
            the allowance refills when the scale next grows (or after every clean step when
            ``consecutive_hysteresis``), as in DeepSpeed's ``DynamicLossScaler``.
        min_loss_scale: the scale never goes below this.

    Usage: multiply the loss by ``scale`` before backward, divide the gradients by it, and call
    ``update(overflow)`` once per optimizer step (``overflow`` must agree on all ranks).

    Raises:
        ValueError: bad arguments (named, with the value).
        LossScaleError: from ``update(True)`` when the scale already equals ``min_loss_scale``.
    """

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False
    scale: float = field(init=False)
    overflows: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.loss_scale < 0:
            raise ValueError(f"loss_scale must be 0 (dynamic) or positive, got {self.loss_scale}")
        if self.loss_scale_window < 1 or self.hysteresis < 1 or self.min_loss_scale <= 0:
            raise ValueError(
                f"need loss_scale_window >= 1 ({self.loss_scale_window}), hysteresis >= 1 "
                f"({self.hysteresis}) and min_loss_scale > 0 ({self.min_loss_scale})"
            )
        self.scale = (
            float(self.loss_scale) if self.loss_scale > 0 else float(2**self.initial_scale_power)
        )
        self._hysteresis_left = self.hysteresis
        self._clean_steps = 0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and adjust the scale (dynamic scaling only)."""
        if overflow:
            self.overflows += 1
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
                return
            if self.scale <= self.min_loss_scale:
                raise LossScaleError(
                    f"fp16 gradients overflow at the minimum loss scale {self.scale:g} (min_loss_scale="
                    f"{self.min_loss_scale:g}, {self.overflows} overflows so far): the gradients are inf/nan "
                    "even unscaled. Train in bf16 (no loss scaling needed), lower min_loss_scale to let the "
                    "scale fall further, or look for the source of inf/nan (learning rate, bad data)"
                )
            self.scale = max(self.scale / 2.0, float(self.min_loss_scale))
            return
        self._clean_steps += 1
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if self._clean_steps % self.loss_scale_window == 0:
            self._hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "overflows": self.overflows,
            "hysteresis_left": self._hysteresis_left,
            "clean_steps": self._clean_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.overflows = int(state.get("overflows", 0))
        self._hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
        self._clean_steps = int(state.get("clean_steps", 0))
