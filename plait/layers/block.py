"""The transformer block: attention + MLP with residuals, pre-norm (GPT-2, Llama) or
post-norm (BERT; Vaswani et al., 2017), with dropout drawn from the right RNG stream and
optional activation recomputation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.layers.attention import Attention, scaled_init_std
from plait.layers.config import TransformerConfig
from plait.layers.mlp import MLP
from plait.layers.moe import MoE, add_loss_gradient
from plait.layers.norm import make_norm
from plait.parallel.random import checkpoint

RECOMPUTE = (None, "full", "selective")


def dropout(
    x: torch.Tensor, p: float, training: bool, rng, sequence_parallel: bool
) -> torch.Tensor:
    """Dropout on the residual stream: the "tp" stream on a sequence shard (masks differ per tp
    rank), the "replicated" stream otherwise (identical masks keep tp replicas identical)."""
    if p == 0.0 or not training:
        return x
    with rng.fork("tp" if sequence_parallel else "replicated"):
        return F.dropout(x, p, True)


class TransformerBlock(nn.Module):
    """One transformer layer. ``forward(hidden, batch)`` maps ``[b, s, h]`` (``[b, s/tp, h]`` with
    sequence parallelism) to the same shape; ``batch`` may hold ``attention_mask [b, s]`` and
    ``position_ids [b, s]`` and ``rope``, the RoPE tables ``(cos, sin)`` (``rope_cos_sin``; the model
    computes them once per forward for all its blocks).

    Args:
        config: architecture. group / sequence_parallel / rng: tp group, sequence parallelism,
            ``RNGTracker``. recompute: None, "full" (recompute the whole block in backward) or
            "selective" (recompute only the attention core; Korthikanti et al., 2022, Sec. 5).
            cp_group / cp_method: context parallelism of the attention (``Attention``). ep_group: expert
            parallelism of a mixture of experts (``MoE``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        group=None,
        sequence_parallel: bool = False,
        rng=None,
        recompute: str | None = None,
        cp_group=None,
        cp_method: str = "ring",
        ep_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"unknown recompute mode {recompute!r}; use one of {RECOMPUTE}")
        c = config
        self.config, self.sequence_parallel, self.rng, self.recompute = (
            c,
            sequence_parallel,
            rng,
            recompute,
        )
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        out_std = scaled_init_std(c.init_std, c.num_layers)
        self.attn_norm = make_norm(c.norm, c.hidden_size, c.norm_eps, c.bias, **kw)
        self.attn = _attention(c, out_std, rng, recompute, cp_group, cp_method, kw)
        self.mlp_norm = make_norm(c.norm, c.hidden_size, c.norm_eps, c.bias, **kw)
        self.mlp = (
            _moe(c, out_std, sequence_parallel, ep_group, device, dtype)
            if c.num_experts
            else MLP(
                c.hidden_size,
                c.ffn_hidden_size,
                c.activation,
                bias=c.bias,
                init_std=c.init_std,
                output_init_std=out_std,
                fused=c.fused_projections,
                chunk_tokens=c.mlp_chunk_tokens,
                **kw,
            )
        )

    def _drop(self, x):
        return dropout(
            x, self.config.hidden_dropout, self.training, self.rng, self.sequence_parallel
        )

    def _ffn(self, x, aux_loss_scale: float):
        """The MLP; a mixture of experts joins its weighted losses to the gradient here (``add_loss_gradient``)."""
        if not self.config.num_experts:
            return self.mlp(x)
        y, aux = self.mlp(x)
        return add_loss_gradient(y, aux.loss, aux_loss_scale)

    def _body(self, x, attention_mask, position_ids, rope, aux_loss_scale=1.0):
        if self.config.post_norm:
            x = self.attn_norm(x + self._drop(self.attn(x, attention_mask, position_ids, rope)))
            return self.mlp_norm(x + self._drop(self._ffn(x, aux_loss_scale)))
        x = x + self._drop(self.attn(self.attn_norm(x), attention_mask, position_ids, rope))
        return x + self._drop(self._ffn(self.mlp_norm(x), aux_loss_scale))

    def forward(self, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
        mask, pos, rope = batch.get("attention_mask"), batch.get("position_ids"), batch.get("rope")
        scale = batch.get("aux_loss_scale", 1.0)  # d(what the backward differentiates) / d(loss)
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            # the tracker replays dropout masks; without dropout it is not needed (and a plain
            # checkpoint traces under torch.compile)
            has_dropout = self.config.hidden_dropout > 0 or self.config.attention_dropout > 0
            return checkpoint(
                self._body,
                hidden,
                mask,
                pos,
                rope,
                scale,
                tracker=self.rng if has_dropout else None,
            )
        return self._body(hidden, mask, pos, rope, scale)


def _attention(
    c: TransformerConfig,
    output_init_std: float,
    rng,
    recompute: str | None,
    cp_group,
    cp_method: str,
    kw: dict,
) -> Attention:
    """The block's attention as ``c`` describes it (``recompute`` "selective": its core recomputed)."""
    return Attention(
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        causal=c.causal,
        rope_theta=c.rope_theta,
        bias=c.bias,
        attention_dropout=c.attention_dropout,
        rng=rng,
        init_std=c.init_std,
        output_init_std=output_init_std,
        recompute_core=recompute == "selective",
        fused=c.fused_projections,
        head_dim=c.head_dim,
        qk_norm=c.qk_norm,
        norm_eps=c.norm_eps,
        cp_group=cp_group,
        cp_method=cp_method,
        **kw,
    )


def _moe(
    c: TransformerConfig, output_init_std: float, sequence_parallel: bool, ep_group, device, dtype
) -> MoE:
    """The mixture-of-experts MLP of ``c`` (its ``moe_*`` fields). Raises ValueError under sequence
    parallelism (each tp rank would route other tokens through replicated experts)."""
    if sequence_parallel:
        raise ValueError(
            "num_experts > 0 with sequence parallelism is not supported yet: use "
            "sequence_parallel=False (the experts run whole on every tp rank)"
        )
    return MoE(
        c.hidden_size,
        c.moe_ffn_hidden_size,
        c.num_experts,
        c.moe_top_k,
        router_order=c.moe_router_order,
        normalize_topk=c.moe_normalize_topk,
        capacity_factor=c.moe_capacity_factor,
        shared_ffn_hidden_size=c.moe_shared_ffn_hidden_size,
        balance_loss_coef=c.moe_balance_loss_coef,
        z_loss_coef=c.moe_z_loss_coef,
        bias_update_rate=c.moe_bias_update_rate,
        init_std=c.init_std,
        output_init_std=output_init_std,
        ep_group=ep_group,
        device=device,
        dtype=dtype,
    )
