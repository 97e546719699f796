"""Self-attention with heads split over tp: MHA and GQA, causal or bidirectional, RoPE or none.

q/k/v projections are column-parallel (each rank computes ``heads/tp`` query heads and
``kv_heads/tp`` key/value heads), the output projection is row-parallel (Shoeybi et al.,
"Megatron-LM", 2019, Sec. 3, Fig. 3b). Grouped-query attention: Ainslie et al., 2023.
Optional q/k norm (Qwen3; Dehghani et al., "Scaling Vision Transformers to 22 Billion Parameters", 2023,
Sec. 3.1): an RMSNorm over each head's ``head_dim`` applied to q and to k before RoPE.
The core is ``torch.nn.functional.scaled_dot_product_attention``; under context parallelism (a ``cp_group``
of more than one rank) it is ``plait.parallel.context``'s ring or all-to-all attention over the sequence
split across those ranks.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import nn

from plait.layers.linear import ColumnParallelLinear, RowParallelLinear, divide, enter_tp_region
from plait.layers.norm import RMSNorm
from plait.layers.rope import apply_rope, rope_cos_sin
from plait.parallel import context
from plait.parallel.collectives import group_size
from plait.parallel.random import checkpoint

CP_METHODS = ("ring", "all_to_all")


def heads_per_rank(
    num_heads: int, num_kv_heads: int, tp: int, cp: int, cp_method: str
) -> tuple[int, int]:
    """This tp rank's query and key/value heads. Raises ValueError (naming the counts and the fix): num_heads
    not a multiple of num_kv_heads, a count not divisible by tp, or (all-to-all cp) by tp x cp."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    heads, kv_heads = divide(num_heads, tp, "num_heads"), divide(num_kv_heads, tp, "num_kv_heads")
    if (
        cp_method == "all_to_all" and cp > 1
    ):  # heads are scattered over the cp ranks of each tp rank
        for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if n % (tp * cp):
                raise ValueError(
                    f"all-to-all context parallelism needs {name} ({n}) divisible by tp x cp = "
                    f"{tp} x {cp}; use cp_method='ring' or other tp/cp sizes"
                )
    return heads, kv_heads


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention.

    Args:
        hidden_size, num_heads: model width and query heads; ``num_kv_heads`` (default num_heads)
            key/value heads. All head counts must divide by tp and num_heads by num_kv_heads.
        head_dim: per-head width (default hidden_size // num_heads).
        causal: mask future positions. rope_theta: apply RoPE with this base (None: no RoPE).
        bias: biases on q/k/v/o. attention_dropout: dropout on attention probabilities.
        group, sequence_parallel, rng: tp group, sequence parallelism, ``RNGTracker`` for dropout.
        recompute_core: selective activation recomputation: keep only q/k/v and recompute the
            attention core (scores, softmax, dropout, weighted sum) in backward (Korthikanti et al.,
            2022, Sec. 5); dropout masks replay exactly through the tracker.
        fused: q/k/v as one column-parallel matmul (``qkv_proj``, each rank's q, k and v rows side
            by side) instead of ``q_proj``, ``k_proj``, ``v_proj``; same logical weights and
            checkpoints either way.
        qk_norm: RMSNorm (epsilon ``norm_eps``) over each head of q and of k before RoPE, weights ``q_norm``
            and ``k_norm`` ``[head_dim]`` shared by all heads; every tp rank holds them whole and sums their
            gradients over tp (its heads are a share of all heads).
        cp_group, cp_method: context parallelism (``plait.parallel.context``): the ranks that split each
            sequence (this rank holds the two chunks of ``context.shard_sequence``) and "ring" or
            "all_to_all". Both take the padding mask (bidirectional); attention dropout only all_to_all.

    Shapes: ``x [b, s, h]`` (``[b, s/tp, h]`` with sequence parallelism); ``attention_mask``
    ``[b, s]`` with 1 for tokens to attend to (bidirectional only); ``position_ids [b, s]``; ``rope``:
    the tables ``(cos, sin)`` of ``rope_cos_sin`` for these positions (``[b or 1, 1, s, head_dim]``),
    computed from ``position_ids`` (default ``0..s-1``) when not given.
    Returns the same shape as ``x``.

    Raises:
        ValueError: head counts not divisible by tp, num_heads not a multiple of num_kv_heads, an unknown
            cp_method; in forward, attention dropout under ring context parallelism.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        causal: bool = True,
        rope_theta: float | None = None,
        bias: bool = False,
        attention_dropout: float = 0.0,
        group=None,
        sequence_parallel: bool = False,
        rng=None,
        init_std: float = 0.02,
        output_init_std: float | None = None,
        recompute_core: bool = False,
        fused: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        cp_group=None,
        cp_method: str = "ring",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if cp_method not in CP_METHODS:
            raise ValueError(
                f"unknown context-parallel method {cp_method!r}; use one of {CP_METHODS}"
            )
        self.cp_group, self.cp_method, self.cp = cp_group, cp_method, group_size(cp_group)
        tp = group_size(group)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.local_heads, self.local_kv_heads = heads_per_rank(
            num_heads, num_kv_heads, tp, self.cp, cp_method
        )
        self.head_dim = head_dim or hidden_size // num_heads
        self.causal, self.rope_theta, self.dropout = causal, rope_theta, attention_dropout
        self.group, self.sequence_parallel, self.rng = group, sequence_parallel, rng
        self.recompute_core, self.fused = recompute_core, fused
        kw = dict(group=group, device=device, dtype=dtype)
        self._build_projections(
            hidden_size, num_heads, num_kv_heads, bias, init_std, output_init_std, kw
        )
        self.qk_norm = qk_norm
        if qk_norm:  # copy_to_tp on the weights (the norms' sequence-parallel path) sums their gradients over tp
            norm_kw = dict(group=group, sequence_parallel=tp > 1, device=device, dtype=dtype)
            self.q_norm = RMSNorm(self.head_dim, norm_eps, **norm_kw)
            self.k_norm = RMSNorm(self.head_dim, norm_eps, **norm_kw)

    def _build_projections(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        init_std: float,
        output_init_std: float | None,
        kw: dict,
    ) -> None:
        """q/k/v (column-parallel; one ``qkv_proj`` when fused) and the row-parallel output projection."""
        sizes = (
            num_heads * self.head_dim,
            num_kv_heads * self.head_dim,
            num_kv_heads * self.head_dim,
        )
        if self.fused:
            self.qkv_proj = ColumnParallelLinear(
                hidden_size,
                sizes,
                bias,
                parts=("q_proj", "k_proj", "v_proj"),
                init_std=init_std,
                **kw,
            )
        else:
            self.q_proj, self.k_proj, self.v_proj = (
                ColumnParallelLinear(hidden_size, n, bias, init_std=init_std, **kw) for n in sizes
            )
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim,
            hidden_size,
            bias,
            sequence_parallel=self.sequence_parallel,
            init_std=output_init_std or init_std,
            **kw,
        )

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        rope=None,
    ) -> torch.Tensor:
        x = enter_tp_region(x, self.group, self.sequence_parallel)  # [b, s, h]
        if self.fused:
            q, k, v = self.qkv_proj.split(self.qkv_proj.local_forward(x))
            if self.rope_theta is not None:
                v = (
                    v.contiguous()
                )  # attention saves v; a view would keep the q/k columns RoPE replaced alive
        else:
            q, k, v = (proj.local_forward(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = (rearrange(t, "b s (n d) -> b n s d", d=self.head_dim) for t in (q, k, v))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            if rope is None:
                if position_ids is None:
                    position_ids = context.positions(
                        x.shape[1] * self.cp, self.cp, self._cp_rank(), x.device
                    ).expand(x.shape[0], -1)
                rope = rope_cos_sin(position_ids, self.head_dim, self.rope_theta)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        mask = (
            None if attention_mask is None or self.causal else attention_mask.bool()
        )  # [b, s] keys to attend
        if self.cp > 1 and self.cp_method == "ring" and self.dropout > 0 and self.training:
            raise ValueError(
                f"ring context parallelism takes no attention dropout (attention_dropout="
                f"{self.dropout}): set attention_dropout 0 or use cp_method 'all_to_all'"
            )
        if self.recompute_core and self.training and torch.is_grad_enabled():
            out = checkpoint(
                self._core, q, k, v, mask, tracker=self.rng if self.dropout > 0 else None
            )
        else:
            out = self._core(q, k, v, mask)
        return self.o_proj(rearrange(out, "b n s d -> b s (n d)"))

    def _cp_rank(self) -> int:
        return 0 if self.cp == 1 else torch.distributed.get_rank(self.cp_group)

    def _core(self, q, k, v, mask):
        """Scaled dot-product attention on this rank's heads: ``[b, heads/tp, s, head_dim]``; ``mask [b, s]``:
        the keys to attend to, or None."""
        if self.cp > 1 and self.cp_method == "ring":
            return context.ring_attention(
                q, k, v, self.cp_group, causal=self.causal, key_padding_mask=mask
            )
        p = self.dropout if self.training else 0.0
        if p > 0.0:
            with self.rng.fork("tp"):  # heads differ per tp (and cp) rank
                return self._gathered_core(q, k, v, mask, p)
        return self._gathered_core(q, k, v, mask, 0.0)

    def _gathered_core(self, q, k, v, mask, p: float):
        """SDPA over the whole sequence: this rank's heads, or under all-to-all cp its share of them."""
        return context.all_to_all_attention(
            q, k, v, self.cp_group, causal=self.causal, key_padding_mask=mask, dropout_p=p
        )


def scaled_init_std(init_std: float, num_layers: int) -> float:
    """GPT-2's residual-projection init, ``std / sqrt(2 * layers)`` (Radford et al., 2019, Sec. 2.3)."""
    return init_std / math.sqrt(2.0 * num_layers)
