"""Feed-forward block with the hidden dim split over tp: GELU (Hendrycks & Gimpel, 2016) or
SwiGLU (Shazeer, "GLU Variants Improve Transformer", 2020, Eq. 6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.layers.linear import ColumnParallelLinear, RowParallelLinear, enter_tp_region
from plait.layers.tiled import sequence_tiles

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")


class MLP(nn.Module):
    """``down(act(up(x)))`` or, for SwiGLU, ``down(silu(gate(x)) * up(x))``.

    Shapes: ``[b, s, h]`` (``[b, s/tp, h]`` with sequence parallelism) -> same; the inner
    ``[b, s, ffn/tp]`` lives on each rank. With ``fused``, SwiGLU's gate and up run as one
    column-parallel matmul (``gate_up_proj``, each rank's gate and up rows side by side); same logical
    weights and checkpoints (``gate_proj``, ``up_proj``) either way. With ``chunk_tokens`` > 0 a longer
    sequence runs in tiles of that many positions and only the input is kept for backward
    (``plait.layers.tiled``). Raises ValueError: ffn_hidden_size not divisible by tp or unknown activation.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "gelu",
        *,
        bias: bool = True,
        group=None,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        output_init_std: float | None = None,
        fused: bool = False,
        chunk_tokens: int = 0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; use one of {ACTIVATIONS}")
        self.chunk_tokens = chunk_tokens
        self.activation, self.group, self.sequence_parallel = activation, group, sequence_parallel
        kw = dict(group=group, device=device, dtype=dtype)
        self.fused = fused and activation == "swiglu"
        if self.fused:
            self.gate_up_proj = ColumnParallelLinear(
                hidden_size,
                (ffn_hidden_size, ffn_hidden_size),
                bias,
                parts=("gate_proj", "up_proj"),
                init_std=init_std,
                **kw,
            )
        else:
            self.up_proj = ColumnParallelLinear(
                hidden_size, ffn_hidden_size, bias, init_std=init_std, **kw
            )
            self.gate_proj = (
                ColumnParallelLinear(hidden_size, ffn_hidden_size, bias, init_std=init_std, **kw)
                if activation == "swiglu"
                else None
            )
        self.down_proj = RowParallelLinear(
            ffn_hidden_size,
            hidden_size,
            bias,
            sequence_parallel=sequence_parallel,
            init_std=output_init_std or init_std,
            **kw,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sequence_tiles(self._forward, x, self.chunk_tokens, self)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp_region(x, self.group, self.sequence_parallel)
        if self.fused:
            gate, up = self.gate_up_proj.split(self.gate_up_proj.local_forward(x))
            inner = F.silu(gate) * up
        elif self.activation == "swiglu":
            inner = F.silu(self.gate_proj.local_forward(x)) * self.up_proj.local_forward(x)
        else:
            up = self.up_proj.local_forward(x)
            inner = F.gelu(up, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(inner)
