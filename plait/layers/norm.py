"""LayerNorm and RMSNorm whose weights are replicated over tp.

Under sequence parallelism a norm sees only its rank's sequence shard ``[b, s/tp, h]``,
so each rank's weight gradient is a partial sum: the weights pass through ``copy_to_tp``
(identity forward, all-reduce backward), which sums them over tp (Korthikanti et al.,
2022, Sec. 4.2.2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.layers.linear import replicated_param
from plait.parallel.collectives import copy_to_tp


class _Norm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        bias: bool,
        group,
        sequence_parallel: bool,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = replicated_param((hidden_size,), "ones", device=device, dtype=dtype)
        self.bias = (
            replicated_param((hidden_size,), "zeros", device=device, dtype=dtype) if bias else None
        )

    def _params(self):
        if not self.sequence_parallel:
            return self.weight, self.bias
        bias = None if self.bias is None else copy_to_tp(self.bias, self.group)
        return copy_to_tp(self.weight, self.group), bias

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class LayerNorm(_Norm):
    """LayerNorm over the last dim (Ba et al., 2016). Shapes: ``[..., h] -> [..., h]``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        group=None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(hidden_size, eps, bias, group, sequence_parallel, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._params()
        return F.layer_norm(x, (self.hidden_size,), weight, bias, self.eps)


def _normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * rstd rounded to x's dtype, rstd)`` with ``rstd = 1/sqrt(mean(x^2) + eps)`` in float32, shape
    ``[..., 1]``: torch's fused RMSNorm forward, the kernel ``F.rms_norm`` runs."""
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)


def _normalize_backward(grad_y: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``dL/dx`` of ``y = x * rstd`` from ``dL/dy`` (same dtype as ``x``): torch's fused kernel on CUDA
    (the one ``F.rms_norm``'s autograd calls); elsewhere its formula in float32,
    ``dx = rstd * (g - y * mean(g * y))`` with ``y = x * rstd``."""
    if x.is_cuda:
        return torch.ops.aten._fused_rms_norm_backward(
            grad_y, x, [x.shape[-1]], rstd, None, [True, False]
        )[0]
    y, g = x.float() * rstd, grad_y.float()
    return (rstd * (g - y * (g * y).mean(-1, keepdim=True))).to(x.dtype)


class _RMSNormWeight(torch.autograd.Function):
    """``rms_norm(x) * w`` saving only ``x`` and ``w``: the normalized ``x`` is recomputed in backward
    (one more read of ``x``) instead of being kept from forward to backward as the separate product would
    keep it, one ``[..., h]`` tensor per norm. Gradients are those of the two separate ops."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        return _normalize(x, eps)[0] * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _RMSNormWeight.plait_gradients(
            ctx, ctx.saved_tensors, grad, ctx.needs_input_grad
        ) + (None,)

    @staticmethod
    def plait_gradients(ctx, saved, grad: torch.Tensor, needs) -> tuple:
        """``(dL/dx, dL/dw)`` from ``dL/dout``, each None where ``needs`` (per forward input) is False; the
        zero-bubble weight pass (``plait.parallel.pipeline.weight_grad``) calls it for ``dL/dw`` alone. (The input
        pass before it also computes ``dL/dw``, as a custom Function cannot tell which outputs the engine
        needs, and discards it.)"""
        x, weight = saved
        y, rstd = _normalize(x, ctx.eps)
        dx = _normalize_backward((grad * weight).to(y.dtype), x, rstd) if needs[0] else None
        dw = (grad * y).sum_to_size(weight.shape).to(weight.dtype) if needs[1] else None
        return dx, dw


class RMSNorm(_Norm):
    """RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` (Zhang & Sennrich, 2019, Eq. 4): the normalization by
    torch's fused RMSNorm kernel (fp32 accumulation for bf16/fp16 inputs), rounded to ``x``'s dtype, then the
    product with ``w``, as Hugging Face's Llama rounds it. Only ``x`` and ``w`` are kept for backward, which
    recomputes the normalization. Shapes: ``[..., h] -> [..., h]``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        group=None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(hidden_size, eps, False, group, sequence_parallel, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, _ = self._params()
        return _RMSNormWeight.apply(x, weight, self.eps)


def make_norm(kind: str, hidden_size: int, eps: float, bias: bool = True, **kw) -> nn.Module:
    """``"layernorm"`` or ``"rmsnorm"``; ValueError for anything else."""
    if kind == "layernorm":
        return LayerNorm(hidden_size, eps, bias, **kw)
    if kind == "rmsnorm":
        return RMSNorm(hidden_size, eps, **kw)
    raise ValueError(f"unknown norm {kind!r}; use 'layernorm' or 'rmsnorm'")
