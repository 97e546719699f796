"""Rotary position embedding (Su et al., "RoFormer", 2021, Eq. 34), in the rotate-half
layout used by Llama and Hugging Face transformers."""

from __future__ import annotations

import torch


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float = 10000.0):
    """cos/sin tables ``[b, 1, s, head_dim]`` (float32) for ``position_ids [b, s]``."""
    inv_freq = 1.0 / (
        theta
        ** (
            torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
        )
    )
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [b, s, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [b, 1, s, hd]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, head_dim]`` by the tables; computed in float32, returned in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
