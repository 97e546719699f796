"""The ``Engine``'s read-side and housekeeping members, under DeepSpeed's names and meanings
(``deepspeed.runtime.engine.DeepSpeedEngine``), so a DeepSpeed script's calls keep working.

Counters follow DeepSpeed: ``global_steps`` counts every optimizer step taken at an accumulation
boundary, applied or skipped (an fp16 overflow, a non-finite gradient); ``skipped_steps`` counts the
skipped ones; the learning-rate schedule advances only on applied steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from plait.parallel.launch import launch_info


class EngineFacts:
    """Mixin of ``plait.engine.Engine``: needs ``module``, ``optimizer`` (a ``ZeroOptimizer``), ``config``,
    ``mesh``, ``experts`` (``plait.engine.moe.ExpertLayers``) and ``_step_applied``."""

    # ---- model access ---------------------------------------------------------------------------------
    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def zero_grad(self) -> None:
        """Discard accumulated gradients and restart the accumulation count (``step`` already does)."""
        self.optimizer.zero_grad()

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        return self.mesh.device

    @property
    def local_rank(self) -> int:
        """This process's index on its node (torchrun's ``LOCAL_RANK`` or SLURM's ``SLURM_LOCALID``; 0 without)."""
        return launch_info().local_rank

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def dp_world_size(self) -> int:
        return self.mesh.dp

    # ---- counters ---------------------------------------------------------------------------------
    @property
    def global_steps(self) -> int:
        """Optimizer steps taken at accumulation boundaries, skipped ones included (DeepSpeed's count)."""
        return self.optimizer.global_steps + self.optimizer.skipped_steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient norm (fp16 overflow, or the nonfinite guard)."""
        return self.optimizer.skipped_steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches since the last optimizer step."""
        return self.optimizer.micro_steps

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last applied step."""
        return self.optimizer.grad_norm

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.grad_norm

    def moe_stats(self) -> dict | None:
        """Mixture-of-experts statistics since the last call: ``aux_loss``, ``load_imbalance`` (max/mean
        tokens per expert, the worst layer) and ``dropped`` (``plait.engine.moe.ExpertLayers.stats``);
        None for a model without expert layers. Collective: every rank calls it."""
        return self.experts.stats()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Per group: Adam's ``betas`` or SGD's ``momentum`` (None when the optimizer has neither)."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        return self._step_applied

    # ---- configuration facts ----------------------------------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.optimizer.is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the accumulation boundary (DeepSpeed's API): ``True`` makes the next ``step()`` apply
        after however many micro-batches were accumulated (an epoch's short last accumulation: the
        gradient is then the sum of those micro-batches' losses / GAS, as in DeepSpeed); ``False``
        holds the step back; ``None`` returns to counting micro-batches. It stays until changed."""
        self.optimizer.boundary_override = None if is_boundary is None else bool(is_boundary)
