"""DeepSpeed's learning-rate schedules, with DeepSpeed's parameter names and step semantics.

Each schedule sets ``lr`` of every param group of the optimizer it wraps at construction (step
-1 -> the warm-up start) and on every ``step()``; ``state_dict()`` is ``{"last_batch_iteration": n}``.
With ``t`` the step index and ``W = max(2, warmup_num_steps)``, the warm-up fraction is
``log(t + 1) / log(W)`` ("log", DeepSpeed's default) or ``t / W`` ("linear"):

* ``WarmupLR``: warm-up from ``min_lr`` to ``max_lr``, then ``max_lr``.
* ``WarmupDecayLR``: the same warm-up, then linear decay to ``min_lr`` at ``total_num_steps = T``.
* ``WarmupCosineLR``: a ratio of each group's initial lr, ``warmup_min_ratio`` -> 1, then cosine to
  ``cos_min_ratio``.

Built directly, the classes check ``warmup_num_steps >= 1`` (as DeepSpeed). The formulas and the ranges a
ds_config is checked against: ``docs/optim.md``.
"""

from __future__ import annotations

import math

WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer, value, what: str) -> list[float]:
    groups = optimizer.param_groups
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(
                f"{what} has {len(value)} values but the optimizer has {len(groups)} param groups"
            )
        return [float(v) for v in value]
    return [float(value)] * len(groups)


class _WarmupBase:
    def __init__(
        self, optimizer, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int
    ):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(
                f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}"
            )
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
        self.optimizer, self.warmup_type = optimizer, warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration

    def _warmup_fraction(self, t: int) -> float:
        if self.warmup_type == "log":
            return math.log(t + 1) / math.log(self.warmup_num_steps)
        return t / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()


class WarmupLR(_WarmupBase):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (default: the groups' lr), then hold."""

    def __init__(
        self,
        optimizer,
        warmup_min_lr=0.0,
        warmup_max_lr=None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self._apply()

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        return self._warmup_fraction(t) if t < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR`` then linear decay to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = int(total_num_steps)
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return self._warmup_fraction(t)
        return max(
            0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps)
        )


class WarmupCosineLR(_WarmupBase):
    """Warm up a ratio of each group's initial lr from ``warmup_min_ratio`` to 1, then cosine-decay
    it to ``cos_min_ratio`` at ``total_num_steps`` (Loshchilov & Hutter, SGDR, 2017, Eq. 5)."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps, self.warmup_min_ratio = int(total_num_steps), float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._apply()

    def ratio(self) -> float:
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction(t) * (1.0 - self.warmup_min_ratio)
        progress = min(
            1.0,
            (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps),
        )
        return max(
            0.0,
            self.cos_min_ratio
            + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2,
        )

    def get_lr(self) -> list[float]:
        r = self.ratio()
        return [lr * r for lr in self.base_lrs]


SCHEDULERS = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}
