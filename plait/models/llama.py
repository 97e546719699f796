"""Llama (Touvron et al., 2023): presets, Hugging Face names and config mapping.

plait's Llama: RoPE, pre-norm RMSNorm, SwiGLU, no biases (or one flag for all), grouped-query
attention, tied or untied head. The q/k projections need no permutation: Hugging Face's
``LlamaForCausalLM`` applies RoPE in the rotate-half layout, as ``plait.layers.rope`` does (the
GGUF files of llama.cpp use the interleaved layout; transformers un-permutes them when it loads
one). The SmolLM2 parity test in ``tests/test_convert_hf.py`` checks this numerically.
"""

from __future__ import annotations

from plait.layers.config import TransformerConfig
from plait.models.family import ModelFamily
from plait.models.hf_base import (
    ROPE_BUFFER,
    HFClasses,
    HFLayout,
    Rule,
    pairs,
    require_fields,
    unsupported,
)


def llama_config(**overrides) -> TransformerConfig:
    """Llama (Touvron et al., 2023); defaults are ANCHORS.md's llama-886m benchmark model."""
    base = dict(
        arch="llama",
        vocab_size=32000,
        hidden_size=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=8,
        ffn_hidden_size=5632,
        max_position_embeddings=2048,
        activation="swiglu",
        norm="rmsnorm",
        norm_eps=1e-5,
        rope_theta=10000.0,
        bias=False,
        tie_embeddings=False,
    )
    return TransformerConfig(**{**base, **overrides})


def _hf_rules(c: TransformerConfig, lay: HFLayout) -> list[Rule]:
    p, L, wb = lay.prefix, c.num_layers, ("weight", "bias") if c.bias else ("weight",)
    out = [Rule(("layers.0.word_embeddings.weight",), (f"{p}embed_tokens.weight",))]
    for i in range(1, L + 1):
        h = f"{p}layers.{i - 1}"
        out += pairs(f"layers.{i}.attn_norm", f"{h}.input_layernorm", ("weight",))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out += pairs(f"layers.{i}.attn.{proj}", f"{h}.self_attn.{proj}", wb)
        out += pairs(f"layers.{i}.mlp_norm", f"{h}.post_attention_layernorm", ("weight",))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out += pairs(f"layers.{i}.mlp.{proj}", f"{h}.mlp.{proj}", wb)
    out += pairs(f"layers.{L + 1}.norm", f"{p}norm", ("weight",))
    if not c.tie_embeddings:
        out.append(Rule((f"layers.{L + 1}.weight",), ("lm_head.weight",)))
    return out


def _rope_theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise unsupported("llama", f"rope scaling {params!r} (plait implements plain RoPE)")
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _config_from_hf(c) -> TransformerConfig:
    mt, heads = c.model_type, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None)
    if head_dim not in (None, c.hidden_size // heads):
        raise unsupported(
            mt, f"head_dim {head_dim} != hidden_size/num_attention_heads ({c.hidden_size}/{heads})"
        )
    if c.hidden_act != "silu":
        raise unsupported(
            mt, f"hidden_act {c.hidden_act!r} (plait's Llama MLP is SwiGLU with silu)"
        )
    attn_bias, mlp_bias = (
        bool(getattr(c, "attention_bias", False)),
        bool(getattr(c, "mlp_bias", False)),
    )
    if attn_bias != mlp_bias:
        raise unsupported(
            mt, f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (plait has one bias flag)"
        )
    return llama_config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        ffn_hidden_size=c.intermediate_size,
        max_position_embeddings=c.max_position_embeddings,
        norm_eps=float(c.rms_norm_eps),
        rope_theta=_rope_theta(c),
        bias=attn_bias,
        tie_embeddings=bool(c.tie_word_embeddings),
        attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        hidden_dropout=0.0,
        init_std=float(c.initializer_range),
    )


def _config_to_hf(c: TransformerConfig, extra: dict):
    from transformers import LlamaConfig

    require_fields(
        c,
        norm="rmsnorm",
        activation="swiglu",
        causal=True,
        post_norm=False,
        type_vocab_size=0,
        num_experts=0,
        qk_norm=False,
    )
    if c.rope_theta is None:
        raise ValueError(
            "plait llama config without rope_theta cannot be written as Hugging Face Llama"
        )
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings,
        hidden_act="silu",
        attention_bias=c.bias,
        mlp_bias=c.bias,
        head_dim=c.head_dim,
        attention_dropout=c.attention_dropout,
        initializer_range=c.init_std,
        **extra,
    )


FAMILY = ModelFamily(
    name="llama",
    hf=HFClasses("llama", "model.", "LlamaModel", "LlamaForCausalLM"),
    presets={
        "llama-886m": lambda: llama_config(),
        "llama-5.9b": lambda: llama_config(
            hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=11008
        ),
        # Llama-3-8B's shape (Meta's config.json of Meta-Llama-3-8B): 8,030,261,248 parameters
        "llama3-8b": lambda: llama_config(
            vocab_size=128256,
            hidden_size=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            ffn_hidden_size=14336,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
        "llama-tiny": lambda: llama_config(
            vocab_size=8192,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=352,
            max_position_embeddings=256,
        ),
    },
    make_config=llama_config,
    hf_rules=_hf_rules,
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
    buffers=ROPE_BUFFER,
)
