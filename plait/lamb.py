"""LAMB: layer-wise adaptive moments (You et al., "Large Batch Optimization for Deep Learning:
Training BERT in 76 minutes", ICLR 2020, Algorithm 2), as a torch optimizer over whole tensors.

Per parameter tensor ``w`` with gradient ``g`` at step ``t``::

    m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
    r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
    w = w - lr * clip(||w|| / ||r||, min_coeff, max_coeff) * r     (ratio 1 when either norm is 0)

The trust-ratio clamp and its defaults (0.01, 10) follow DeepSpeed's FusedLamb, whose config keys
``min_coeff``/``max_coeff`` plait accepts. The trust ratio needs the whole tensor, so LAMB runs on unflattened parameters
(ZeRO stage 0 without flattening, as DeepSpeed also requires).
"""
from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB over per-tensor parameters. ``bias_correction=False`` drops the ``1 - b^t`` factors."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True, min_coeff: float = 0.01,
                 max_coeff: float = 10.0):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, min_coeff=min_coeff, max_coeff=max_coeff))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
                w = p.float()
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(w, alpha=group["weight_decay"])
                w_norm, u_norm = w.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0),
                                    (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
                                    torch.ones_like(w_norm))
                p.copy_((w - group["lr"] * trust * update).to(p.dtype))
        return loss
