"""Qwen3-MoE (Qwen Team, "Qwen3 Technical Report", 2025): presets, Hugging Face names and config mapping.

plait's Qwen3-MoE is its Mixtral (``plait.models.mixtral``: Llama attention and norms, every MLP a dropless
mixture of SwiGLU experts, softmax then top-k) with q/k norm (``TransformerConfig.qk_norm``: an RMSNorm over
each head of q and of k before RoPE, HF's ``self_attn.q_norm`` / ``k_norm``), heads of ``head_dim`` not
tied to hidden/heads, and the top-k renormalized only with ``norm_topk_prob`` (``moe_normalize_topk``).

Expert weights on the hub, and as transformers 5.24's ``save_pretrained`` writes them: one ``Linear`` per
expert, ``mlp.experts.{j}.gate_proj`` / ``up_proj`` / ``down_proj``, the router at ``mlp.gate``; transformers
5 holds them fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2 ffn, h]``, ``mlp.experts.down_proj``). An
import reads either layout; an export writes the hub's. Every layer must be sparse (``decoder_sparse_step``
1, no ``mlp_only_layers``): plait's blocks are all dense or all mixtures. The balance loss coefficient maps to
``router_aux_loss_coef`` with the caveat of ``plait.models.mixtral`` (plait sums it per block).
"""

from __future__ import annotations

from plait.layers.config import TransformerConfig
from plait.models.family import ModelFamily
from plait.models.hf_base import (
    ROPE_BUFFER,
    HFClasses,
    HFLayout,
    Rule,
    decoder_rules,
    expert_rules,
    moe_config_fields,
    pairs,
    require_moe_export,
    unsupported,
)


def qwen3_moe_config(**overrides) -> TransformerConfig:
    """Qwen3-MoE; defaults are Qwen3-30B-A3B (the hub's ``config.json``: 48 layers, hidden 2048, 32 query and 4
    kv heads of 128, 128 experts of width 768, top-8 renormalized, RoPE base 1e6, untied)."""
    base = dict(
        arch="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_size=6144,
        max_position_embeddings=40960,
        activation="swiglu",
        norm="rmsnorm",
        norm_eps=1e-6,
        rope_theta=1e6,
        bias=False,
        tie_embeddings=False,
        qk_norm=True,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden_size=768,
        moe_router_order="softmax_topk",
        moe_normalize_topk=True,
        moe_balance_loss_coef=0.001,
    )
    return TransformerConfig(**{**base, **overrides})


def _hf_rules(c: TransformerConfig, lay: HFLayout) -> list[Rule]:
    def layer(pl: str, h: str) -> list[Rule]:
        return [
            *pairs(f"{pl}.attn.q_norm", f"{h}.self_attn.q_norm", ("weight",)),
            *pairs(f"{pl}.attn.k_norm", f"{h}.self_attn.k_norm", ("weight",)),
            Rule((f"{pl}.mlp.router_weight",), (f"{h}.mlp.gate.weight",)),
            *expert_rules(
                f"{pl}.mlp",
                f"{h}.mlp.experts",
                ("gate_proj", "up_proj", "down_proj"),
                f"{h}.mlp.experts",
                c.num_experts,
            ),
        ]

    return decoder_rules(c, lay, layer)


def _config_from_hf(c) -> TransformerConfig:
    """plait config of an HF ``Qwen3MoeConfig``.

    Raises:
        ValueError: naming the field and value plait cannot express: ``decoder_sparse_step`` != 1, non-empty
            ``mlp_only_layers``, ``num_experts`` < 1, ``attention_bias``, a sliding window, rope scaling,
            ``hidden_act`` other than silu.
    """
    mt = c.model_type
    step, dense = (
        getattr(c, "decoder_sparse_step", 1),
        list(getattr(c, "mlp_only_layers", None) or []),
    )
    if step != 1:
        raise unsupported(
            mt,
            f"decoder_sparse_step {step} (plait makes every layer's MLP a mixture of experts; "
            f"it needs 1)",
        )
    if dense:
        raise unsupported(
            mt, f"mlp_only_layers {dense} (plait makes every layer's MLP a mixture of experts)"
        )
    if c.num_experts < 1:
        raise unsupported(mt, f"num_experts {c.num_experts} (a dense Qwen3 is not a qwen3_moe)")
    if getattr(c, "attention_bias", False):
        raise unsupported(mt, "attention_bias True (plait's Qwen3-MoE has no biases)")
    if getattr(c, "use_sliding_window", False):
        raise unsupported(mt, f"use_sliding_window True (sliding_window {c.sliding_window})")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return qwen3_moe_config(
        **moe_config_fields(c, mt),
        head_dim=head_dim,
        ffn_hidden_size=c.intermediate_size,
        num_experts=c.num_experts,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_normalize_topk=bool(c.norm_topk_prob),
    )


def _config_to_hf(c: TransformerConfig, extra: dict):
    from transformers import Qwen3MoeConfig

    require_moe_export(c, qk_norm=True)
    return Qwen3MoeConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        attention_dropout=c.attention_dropout,
        initializer_range=c.init_std,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_experts=c.num_experts,
        num_experts_per_tok=c.moe_top_k,
        moe_intermediate_size=c.moe_ffn_hidden_size,
        norm_topk_prob=c.moe_normalize_topk,
        router_aux_loss_coef=c.moe_balance_loss_coef,
        **extra,
    )


FAMILY = ModelFamily(
    name="qwen3_moe",
    hf=HFClasses("qwen3_moe", "model.", "Qwen3MoeModel", "Qwen3MoeForCausalLM"),
    presets={
        "qwen3-30b-a3b": lambda: qwen3_moe_config(),
        "qwen3-moe-tiny": lambda: qwen3_moe_config(
            vocab_size=8192,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=48,
            ffn_hidden_size=384,
            max_position_embeddings=256,
            num_experts=8,
            moe_top_k=2,
            moe_ffn_hidden_size=96,
        ),
    },
    make_config=qwen3_moe_config,
    hf_rules=_hf_rules,
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
    buffers=ROPE_BUFFER,
)
