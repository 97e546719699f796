"""A hand-written Llama in plain torch, independent of plait (the reference for bench_compile.py).

RMSNorm (pre-norm), rotate-half RoPE, one fused qkv Linear, SDPA causal attention with grouped-query
heads, SwiGLU with one fused gate/up Linear, untied head, no biases, mean cross entropy over all
tokens. ``HandLlama(**shape)`` takes the sizes by keyword (``llama_shape`` lists them), so a
benchmark can build it at the shape of any other implementation; ``blocks`` is a ModuleList, for
regional compilation (``block.compile()``) and per-block FSDP2 wrapping. ``forward(..., position_ids)``
takes each token's global position for RoPE (context parallelism, where a rank holds only some of the
sequence's tokens); a block with ``repeat_kv`` set copies the kv heads to every query head before SDPA
instead of passing ``enable_gqa`` (bench_context_parallel.py's torch-cp-repkv arm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: The keyword arguments of ``HandLlama``.
llama_shape = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "rope_theta",
    "norm_eps",
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(
    seq: int, head_dim: int, theta: float, device, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[seq, head_dim]`` in fp32 (rotate-half layout: the two halves share frequencies) for the
    positions ``0 .. seq-1``; given ``positions [b, s]`` (integer token positions), ``[b, 1, s, head_dim]``:
    the rows of those positions, broadcasting over the heads."""
    inv = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    if positions is None:
        ang = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    else:
        ang = (positions.to(torch.float32)[..., None] * inv).unsqueeze(1)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """``x [b, heads, s, d]``: rotate in fp32, back to ``x``'s dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, ffn_hidden_size, norm_eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, hidden_size // num_heads
        self.ffn, self.repeat_kv = ffn_hidden_size, False
        self.attn_norm = RMSNorm(hidden_size, norm_eps)
        self.qkv = nn.Linear(
            hidden_size, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=False
        )
        self.o = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.mlp_norm = RMSNorm(hidden_size, norm_eps)
        self.gate_up = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False)
        self.down = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def attention(self, x, cos, sin):
        b, s, _ = x.shape
        d, nq, nkv = self.head_dim, self.heads, self.kv_heads
        q, k, v = self.qkv(x).split((nq * d, nkv * d, nkv * d), dim=-1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = nq != nkv
        if gqa and self.repeat_kv:  # each query head gets its own copy of its kv head
            k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o(out.transpose(1, 2).reshape(b, s, nq * d))

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attn_norm(x), cos, sin)
        gate, up = self.gate_up(self.mlp_norm(x)).split(self.ffn, dim=-1)
        return x + self.down(F.silu(gate) * up)


class HandLlama(nn.Module):
    """``forward(input_ids [b, s], labels [b, s] | None, position_ids [b or 1, s] | None)``: the mean loss, or
    the logits without labels; RoPE at ``position_ids`` (default ``0 .. s-1``)."""

    def __init__(
        self,
        *,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        ffn_hidden_size,
        rope_theta=10000.0,
        norm_eps=1e-5,
        init_std=0.02,
    ):
        super().__init__()
        self.theta, self.head_dim = rope_theta, hidden_size // num_heads
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(
            Block(hidden_size, num_heads, num_kv_heads, ffn_hidden_size, norm_eps)
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, norm_eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, init_std)

    def forward(self, input_ids, labels=None, position_ids=None):
        cos, sin = rope_tables(
            input_ids.shape[1], self.head_dim, self.theta, input_ids.device, position_ids
        )
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
