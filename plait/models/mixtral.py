"""Mixtral (Jiang et al., "Mixtral of Experts", 2024): presets, Hugging Face names and config mapping.

plait's Mixtral is its Llama (RoPE, pre-norm RMSNorm, grouped-query attention, no biases) with every MLP a
mixture of SwiGLU experts (``plait.layers.MoE``): the router's softmax over the experts, the top
``moe_top_k`` (2 in Mixtral 8x7B) renormalized to sum to 1 (``moe_router_order="softmax_topk"``,
``moe_normalize_topk=True``), dropless (every token reaches its experts, as in transformers).

An import reads both the hub's per-expert names (``block_sparse_moe.experts.{j}.w1/w3/w2``) and
transformers 5's fused ones; an export writes the hub's. The balance loss coefficient maps to HF's
``router_aux_loss_coef`` but weighs balancing about ``num_layers`` times more in plait (``docs/layers.md``).
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
    require_moe_export,
    unsupported,
)


def mixtral_config(**overrides) -> TransformerConfig:
    """Mixtral; defaults are Mixtral 8x7B (Jiang et al., 2024, Table 1; the hub's ``config.json``)."""
    base = dict(
        arch="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        max_position_embeddings=32768,
        activation="swiglu",
        norm="rmsnorm",
        norm_eps=1e-5,
        rope_theta=1e6,
        bias=False,
        tie_embeddings=False,
        num_experts=8,
        moe_top_k=2,
        moe_router_order="softmax_topk",
        moe_normalize_topk=True,
        moe_balance_loss_coef=0.02,
    )
    return TransformerConfig(**{**base, **overrides})


def _hf_rules(c: TransformerConfig, lay: HFLayout) -> list[Rule]:
    def layer(pl: str, h: str) -> list[Rule]:
        moe = f"{h}.block_sparse_moe"
        return [
            Rule(
                (f"{pl}.mlp.router_weight",),
                (f"{moe}.gate.weight",),
                aliases=((f"{h}.mlp.gate.weight",),),
            ),
            *expert_rules(
                f"{pl}.mlp", f"{moe}.experts", ("w1", "w3", "w2"), f"{h}.mlp.experts", c.num_experts
            ),
        ]

    return decoder_rules(c, lay, layer)


def _config_from_hf(c) -> TransformerConfig:
    """plait config of an HF ``MixtralConfig``.

    Raises:
        ValueError: naming the field and value plait cannot express: ``sliding_window`` set,
            ``router_jitter_noise`` != 0 (plait's router has no jitter), rope scaling, ``hidden_act`` other
            than silu.
    """
    mt = c.model_type
    jitter = float(getattr(c, "router_jitter_noise", 0.0) or 0.0)
    if jitter:
        raise unsupported(
            mt, f"router_jitter_noise {jitter} (plait's router adds no noise; set it to 0)"
        )
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return mixtral_config(
        **moe_config_fields(c, mt),
        head_dim=head_dim,
        ffn_hidden_size=c.intermediate_size,
        num_experts=c.num_local_experts,
    )


def _config_to_hf(c: TransformerConfig, extra: dict):
    from transformers import MixtralConfig

    require_moe_export(c, moe_normalize_topk=True, qk_norm=False)
    return MixtralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.moe_ffn_hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings,
        sliding_window=None,
        attention_dropout=c.attention_dropout,
        initializer_range=c.init_std,
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.moe_top_k,
        router_aux_loss_coef=c.moe_balance_loss_coef,
        router_jitter_noise=0.0,
        **extra,
    )


FAMILY = ModelFamily(
    name="mixtral",
    hf=HFClasses("mixtral", "model.", "MixtralModel", "MixtralForCausalLM"),
    presets={
        "mixtral-8x7b": lambda: mixtral_config(),
        # 1,037,371,392 active of 3,151,300,608 parameters: num_parameters() minus, per layer, the 6 unused
        # experts' 3 x 2048 x 3584 weights (tests/test_convert_hf_moe.py computes both). 8x7B: 12.9B of 46.7B
        "mixtral-1b-active": lambda: mixtral_config(
            hidden_size=2048,
            num_layers=16,
            num_heads=16,
            num_kv_heads=8,
            ffn_hidden_size=3584,
            max_position_embeddings=4096,
        ),
        "mixtral-tiny": lambda: mixtral_config(
            vocab_size=8192,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=256,
            max_position_embeddings=256,
            num_experts=4,
        ),
    },
    make_config=mixtral_config,
    hf_rules=_hf_rules,
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
    buffers=ROPE_BUFFER,
)
