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
    def __init__(self, hidden_size: int, eps: float, bias: bool, group, sequence_parallel: bool,
                 device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = replicated_param((hidden_size,), "ones", device=device, dtype=dtype)
        self.bias = replicated_param((hidden_size,), "zeros", device=device, dtype=dtype) if bias else None

    def _params(self):
        if not self.sequence_parallel:
            return self.weight, self.bias
        bias = None if self.bias is None else copy_to_tp(self.bias, self.group)
        return copy_to_tp(self.weight, self.group), bias

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class LayerNorm(_Norm):
    """LayerNorm over the last dim (Ba et al., 2016). Shapes: ``[..., h] -> [..., h]``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(hidden_size, eps, bias, group, sequence_parallel, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._params()
        return F.layer_norm(x, (self.hidden_size,), weight, bias, self.eps)


class RMSNorm(_Norm):
    """RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` (Zhang & Sennrich, 2019, Eq. 4): the normalization by
    torch's ``F.rms_norm`` (fp32 accumulation for bf16/fp16 inputs, one fused kernel on CUDA), rounded to
    ``x``'s dtype, then the product with ``w``, as Hugging Face's Llama rounds it. The weight stays a
    separate product so the zero-bubble weight pass (``plait.parallel.weight_grad``) computes its gradient.
    Shapes: ``[..., h] -> [..., h]``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(hidden_size, eps, False, group, sequence_parallel, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, _ = self._params()
        return F.rms_norm(x, (self.hidden_size,), None, self.eps) * weight


def make_norm(kind: str, hidden_size: int, eps: float, bias: bool = True, **kw) -> nn.Module:
    """``"layernorm"`` or ``"rmsnorm"``; ValueError for anything else."""
    if kind == "layernorm":
        return LayerNorm(hidden_size, eps, bias, **kw)
    if kind == "rmsnorm":
        return RMSNorm(hidden_size, eps, **kw)
    raise ValueError(f"unknown norm {kind!r}; use 'layernorm' or 'rmsnorm'")
