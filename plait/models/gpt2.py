"""GPT-2 (Radford et al., 2019): presets, Hugging Face names and config mapping.

plait's GPT-2: learned positions, pre-norm LayerNorm, GELU (tanh approximation), biases, tied
head. Hugging Face ``GPT2LMHeadModel`` stores linear weights as ``Conv1D`` (``[in, out]``, so
they are transposed) and fuses q, k, v into ``attn.c_attn`` (``[h, 3h]``).
"""

from __future__ import annotations

import re

from plait.layers.config import TransformerConfig
from plait.models.family import ModelFamily
from plait.models.hf_base import HFClasses, HFLayout, Rule, pairs, require_fields, unsupported

_MASK_BUFFER = re.compile(
    r"(^|\.)h\.\d+\.attn\.(masked_)?bias$"
)  # causal-mask buffers, not weights
#: HF activation_function -> plait activation.
_GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def gpt2_config(**overrides) -> TransformerConfig:
    """GPT-2 (Radford et al., 2019); defaults are GPT-2 small (124M)."""
    base = dict(
        arch="gpt2",
        vocab_size=50257,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        max_position_embeddings=1024,
        activation="gelu_tanh",
        norm="layernorm",
        bias=True,
        tie_embeddings=True,
    )
    return TransformerConfig(**{**base, **overrides})


def _hf_rules(c: TransformerConfig, lay: HFLayout) -> list[Rule]:
    p, L, wb = lay.prefix, c.num_layers, ("weight", "bias")
    out = [
        Rule(("layers.0.word_embeddings.weight",), (f"{p}wte.weight",)),
        Rule(("layers.0.position_embeddings",), (f"{p}wpe.weight",)),
    ]
    for i in range(1, L + 1):
        h, a = f"{p}h.{i - 1}", f"layers.{i}.attn"
        out += pairs(f"layers.{i}.attn_norm", f"{h}.ln_1", wb)
        out.append(
            Rule(
                (f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"),
                (f"{h}.attn.c_attn.weight",),
                "qkv_conv1d",
            )
        )
        out.append(
            Rule(
                (f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"),
                (f"{h}.attn.c_attn.bias",),
                "qkv_bias",
            )
        )
        out += pairs(f"{a}.o_proj", f"{h}.attn.c_proj", ("weight",), "transpose")
        out += pairs(f"{a}.o_proj", f"{h}.attn.c_proj", ("bias",))
        out += pairs(f"layers.{i}.mlp_norm", f"{h}.ln_2", wb)
        out += pairs(f"layers.{i}.mlp.up_proj", f"{h}.mlp.c_fc", ("weight",), "transpose")
        out += pairs(f"layers.{i}.mlp.up_proj", f"{h}.mlp.c_fc", ("bias",))
        out += pairs(f"layers.{i}.mlp.down_proj", f"{h}.mlp.c_proj", ("weight",), "transpose")
        out += pairs(f"layers.{i}.mlp.down_proj", f"{h}.mlp.c_proj", ("bias",))
    out += pairs(f"layers.{L + 1}.norm", f"{p}ln_f", wb)
    if not c.tie_embeddings:
        out.append(Rule((f"layers.{L + 1}.weight",), ("lm_head.weight",)))
    return out


def _config_from_hf(c) -> TransformerConfig:
    mt = c.model_type
    if c.activation_function not in _GELU:
        raise unsupported(
            mt, f"activation_function {c.activation_function!r}; use one of {sorted(_GELU)}"
        )
    if (
        not c.scale_attn_weights
        or c.scale_attn_by_inverse_layer_idx
        or getattr(c, "add_cross_attention", False)
    ):
        raise unsupported(
            mt, "scale_attn_weights=False, scale_attn_by_inverse_layer_idx or cross-attention"
        )
    return gpt2_config(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        num_layers=c.n_layer,
        num_heads=c.n_head,
        ffn_hidden_size=c.n_inner or 4 * c.n_embd,
        max_position_embeddings=c.n_positions,
        activation=_GELU[c.activation_function],
        norm_eps=float(c.layer_norm_epsilon),
        tie_embeddings=bool(c.tie_word_embeddings),
        hidden_dropout=float(c.resid_pdrop),
        attention_dropout=float(c.attn_pdrop),
        init_std=float(c.initializer_range),
    )


def _config_to_hf(c: TransformerConfig, extra: dict):
    from transformers import GPT2Config

    require_fields(
        c,
        norm="layernorm",
        causal=True,
        post_norm=False,
        bias=True,
        type_vocab_size=0,
        rope_theta=None,
        num_kv_heads=c.num_heads,
        num_experts=0,
        head_dim=c.hidden_size // c.num_heads,
        qk_norm=False,
    )
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}.get(c.activation)
    if act is None:
        raise ValueError(
            f"plait gpt2 activation {c.activation!r} has no Hugging Face GPT-2 equivalent"
        )
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.max_position_embeddings,
        n_embd=c.hidden_size,
        n_layer=c.num_layers,
        n_head=c.num_heads,
        n_inner=None if c.ffn_hidden_size == 4 * c.hidden_size else c.ffn_hidden_size,
        activation_function=act,
        layer_norm_epsilon=c.norm_eps,
        resid_pdrop=c.hidden_dropout,
        embd_pdrop=c.hidden_dropout,
        attn_pdrop=c.attention_dropout,
        initializer_range=c.init_std,
        tie_word_embeddings=c.tie_embeddings,
        **extra,
    )


FAMILY = ModelFamily(
    name="gpt2",
    hf=HFClasses("gpt2", "transformer.", "GPT2Model", "GPT2LMHeadModel"),
    presets={
        "gpt2-124m": lambda: gpt2_config(),
        "gpt2-tiny": lambda: gpt2_config(
            vocab_size=8192, hidden_size=128, num_layers=4, num_heads=4, max_position_embeddings=256
        ),
    },
    make_config=gpt2_config,
    hf_rules=_hf_rules,
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
    buffers=_MASK_BUFFER,
)
