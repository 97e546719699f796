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

import logging

import torch
import torch.distributed as dist
from torch import nn

from plait.layers.moe import MoE
from plait.parallel.pipeline.stage import takes_keyword


class ExpertLayers:
    """The ``MoE`` layers of this rank's model part (none: every method is a no-op).

    Args:
        module: the engine's module (a model, or the pipeline's chunks as an ``nn.ModuleList``).
        mesh: the ``ParallelMesh``: tokens are counted over ``group("dp_cp")``, statistics over ``pp`` too.
    """

    def __init__(self, module: nn.Module, mesh):
        self.layers = [m for m in module.modules() if isinstance(m, MoE)]
        self.mesh = mesh
        self.takes_scale = bool(self.layers) and takes_keyword(module, "aux_loss_scale")
        if self.layers and not self.takes_scale:
            logging.getLogger("plait").warning(
                "the model's forward takes no aux_loss_scale: its mixture-of-experts layers' losses reach the "
                "gradient unscaled by the loss scale and 1/gradient_accumulation_steps (pass it on to the blocks "
                "in their batch, as plait.layers.TransformerModel does)"
            )
        # whether any pipeline stage holds expert layers (a stage may hold only the head): collective, once
        flag = torch.tensor([float(bool(self.layers))], device=mesh.device)
        if mesh.pp > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.pp_group)
        self.anywhere = bool(flag.item())
        if mesh.ep > 1 and not self.anywhere:
            logging.getLogger("plait").warning(
                "mesh ep=%d but the model has no plait.layers.MoE layer: ep has no effect", mesh.ep
            )

    def forward_kwargs(self, kwargs: dict, scale: float) -> dict:
        """``kwargs`` with ``aux_loss_scale=scale`` when there are expert layers and the model takes it."""
        return {**kwargs, "aux_loss_scale": scale} if self.takes_scale else kwargs

    def after_step(self) -> None:
        """One auxiliary-loss-free bias step of every layer (``MoE.update_expert_bias``) over the dp x cp ranks."""
        for layer in self.layers:
            layer.update_expert_bias(self.mesh.group("dp_cp"))

    def stats(self) -> dict | None:
        """The training forwards since the last call, over every rank (collective on all of them): ``aux_loss``,
        the mean over forwards of the summed weighted losses of this model's layers (balance x its coefficient
        + z x its coefficient); ``load_imbalance``, the largest over layers of max/mean tokens per expert; and
        ``dropped``, the fraction of assignments over capacity. None without expert layers or forwards."""
        if not self.anywhere:
            return None
        out = self._local() if self.layers else torch.zeros(5, device=self.mesh.device)
        if (
            self.mesh.pp > 1
        ):  # stages hold other layers: sum their losses and counts, the largest imbalance
            maxed = out[3:].clone()
            dist.all_reduce(out, group=self.mesh.pp_group)
            dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=self.mesh.pp_group)
            out[3:] = maxed
        aux, dropped, assigned, forwards, imbalance = out.tolist()
        if forwards == 0:
            return None
        return {
            "aux_loss": aux,
            "load_imbalance": imbalance,
            "dropped": dropped / max(assigned, 1.0),
        }

    def _local(self) -> torch.Tensor:
        """This stage's ``[aux, dropped, assigned, forwards, imbalance]`` over its dp x cp ranks (collective)."""
        stats = torch.stack([layer.take_stats() for layer in self.layers])  # [layers, E + 4]
        group = self.mesh.group("dp_cp")
        if group is not None:
            dist.all_reduce(stats, group=group)
        counts, (balance, z, dropped, forwards) = stats[:, :-4], stats[:, -4:].unbind(1)
        coefs = torch.tensor(
            [[m.balance_loss_coef, m.z_loss_coef] for m in self.layers], device=stats.device
        )
        aux = ((coefs[:, 0] * balance + coefs[:, 1] * z) / forwards.clamp(min=1)).sum()
        imbalance = (counts.amax(1) / counts.mean(1).clamp(min=1e-9)).amax()
        return torch.stack([aux, dropped.sum(), counts.sum(), forwards.amax(), imbalance])
