"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
arXiv:1904.00962 / ICLR 2020, Algorithm 2) as a torch optimizer, with one trust ratio per logical tensor.

Per tensor ``w`` with gradient ``g`` at step ``t`` (float32 moments; ``bias_correction=False`` drops
the ``1 - b^t`` factors)::

    m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
    r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w         (weight decay inside r)
    w = w - lr * clip(||w|| / ||r||, min_coeff, max_coeff) * r           (ratio 1 if either norm is 0)

Over whole parameters each parameter is one tensor; over ZeRO's flat fp32 shards ``set_segments``
(``plait.optim.lamb_segments``) maps shard elements to logical tensors, so the ratio equals one process's.
Not offered with ``offload_optimizer``. The clipped ratio against Algorithm 2's ``phi``: ``docs/optim.md``.
"""

from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB over per-tensor parameters. ``bias_correction=False`` drops the ``1 - b^t`` factors."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        min_coeff: float = 0.01,
        max_coeff: float = 10.0,
    ):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr}, betas={betas}, eps={eps}")
        super().__init__(
            params,
            dict(
                lr=lr,
                betas=tuple(betas),
                eps=eps,
                weight_decay=weight_decay,
                bias_correction=bias_correction,
                min_coeff=min_coeff,
                max_coeff=max_coeff,
            ),
        )

    def set_segments(self, segments: dict, num_tensors: int, reduce) -> None:
        """Switch to per-tensor trust ratios over flat buffers.

        Args:
            segments: ``{id(flat_param): [(offset, length, tensor_index), ...]}`` pieces of each flat param.
            num_tensors: number of logical tensors (indices into the norm vectors).
            reduce: ``reduce(sq: Tensor[2, num_tensors]) -> Tensor`` summing squared norms (row 0: weights,
                row 1: updates) over every rank holding pieces of each tensor (collective).
        """
        self._segments, self._num_tensors, self._reduce = segments, num_tensors, reduce

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if getattr(self, "_segments", None) is not None:
            self._flat_step()
            return loss
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                w, update = self._moments(p, group)
                w_norm, u_norm = w.norm(), update.norm()
                trust = torch.where(
                    (w_norm > 0) & (u_norm > 0),
                    (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
                    torch.ones_like(w_norm),
                )
                p.copy_((w - group["lr"] * trust * update).to(p.dtype))
        return loss

    def _moments(self, p, group) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance the moments of ``p`` and return ``(w, update)`` in float32 (before the trust ratio)."""
        b1, b2 = group["betas"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        t, g = state["step"], p.grad.float()
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        c1, c2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
        w = p.float()
        update = (m / c1) / ((v / c2).sqrt() + group["eps"])
        if group["weight_decay"]:
            update.add_(w, alpha=group["weight_decay"])
        return w, update

    def _flat_step(self) -> None:
        work = []
        device = self.param_groups[0]["params"][0].device
        sq = torch.zeros(2, self._num_tensors, dtype=torch.float64, device=device)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                w, update = self._moments(p, group)
                for offset, length, index in self._segments[id(p)]:
                    sq[0, index] += w[offset : offset + length].double().square().sum()
                    sq[1, index] += update[offset : offset + length].double().square().sum()
                work.append((p, group, w, update))
        norms = self._reduce(sq).sqrt()
        ok = (norms[0] > 0) & (norms[1] > 0)
        trust = torch.ones(self._num_tensors, dtype=torch.float64, device=norms.device)
        for p, group, w, update in work:
            ratio = torch.where(
                ok,
                (norms[0] / norms[1].clamp_min(1e-300)).clamp(
                    group["min_coeff"], group["max_coeff"]
                ),
                trust,
            )
            scale = torch.zeros_like(w)  # padding elements stay put
            for offset, length, index in self._segments[id(p)]:
                scale[offset : offset + length] = ratio[index]
            p.copy_((w - group["lr"] * scale * update).to(p.dtype))
