"""What the ``Engine`` does for a model's mixture-of-experts layers (``plait.layers.MoE``).

* The auxiliary losses' gradient scale: each layer joins its balance and z losses to the gradient itself
  (``plait.layers.moe.add_loss_gradient``), so the engine passes every forward ``aux_loss_scale`` =
  d(what its backward differentiates)/d(loss) = ``loss_scale / gradient_accumulation_steps``, the factor
  ``ZeroOptimizer.scale_loss`` applies to the loss (a pipeline's executor passes the same to its chunks).
* Auxiliary-loss-free balancing (DeepSeek-V3): after each applied optimizer step every layer's expert bias
  moves from the tokens counted over the step on all data-parallel (x context-parallel) ranks.
* Statistics for the progress line: the mean auxiliary loss and the load imbalance since the last read.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.layers.moe import MoE


class ExpertLayers:
    """The ``MoE`` layers of this rank's model part (none: every method is a no-op).

    Args:
        module: the engine's module (a model, or the pipeline's chunks as an ``nn.ModuleList``).
        mesh: the ``ParallelMesh``: tokens are counted over ``group("dp_cp")``, statistics over ``pp`` too.
    """

    def __init__(self, module: nn.Module, mesh):
        self.layers = [m for m in module.modules() if isinstance(m, MoE)]
        self.mesh = mesh

    def __bool__(self) -> bool:
        return bool(self.layers)

    def forward_kwargs(self, kwargs: dict, scale: float) -> dict:
        """``kwargs`` with ``aux_loss_scale=scale`` when there are expert layers (else unchanged)."""
        return {**kwargs, "aux_loss_scale": scale} if self.layers else kwargs

    def after_step(self) -> None:
        """One auxiliary-loss-free bias step of every layer (``MoE.update_expert_bias``) over the dp x cp ranks."""
        for layer in self.layers:
            layer.update_expert_bias(self.mesh.group("dp_cp"))

    def stats(self) -> dict | None:
        """The training forwards since the last call, over every rank (collective on all of them): ``aux_loss``,
        the mean over forwards of the summed weighted losses of this model's layers (balance x its coefficient
        + z x its coefficient); ``load_imbalance``, the largest over layers of max/mean tokens per expert; and
        ``dropped``, the fraction of assignments over capacity. None without expert layers or forwards."""
        if not self.layers:
            return None
        stats = torch.stack([layer.take_stats() for layer in self.layers])   # [layers, E + 4]
        group = self.mesh.group("dp_cp")
        if group is not None:
            dist.all_reduce(stats, group=group)
        counts, (balance, z, dropped, forwards) = stats[:, :-4], stats[:, -4:].unbind(1)
        coefs = torch.tensor([[m.balance_loss_coef, m.z_loss_coef] for m in self.layers], device=stats.device)
        per_forward = forwards.clamp(min=1)
        aux = ((coefs[:, 0] * balance + coefs[:, 1] * z) / per_forward).sum()
        imbalance = (counts.amax(1) / counts.mean(1).clamp(min=1e-9)).amax()
        out = torch.stack([aux, dropped.sum(), counts.sum(), forwards.amax(), imbalance])
        if self.mesh.pp > 1:   # stages hold other layers: sum their losses and counts, the largest imbalance
            maxed = out[3:].clone()
            dist.all_reduce(out, group=self.mesh.pp_group)
            dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=self.mesh.pp_group)
            out[3:] = maxed
        aux, dropped, assigned, forwards, imbalance = out.tolist()
        if forwards == 0:
            return None
        return {"aux_loss": aux, "load_imbalance": imbalance, "dropped": dropped / max(assigned, 1.0)}
