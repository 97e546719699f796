"""BERT (Devlin et al., 2019): presets, Hugging Face names and config mapping.

plait's BERT: learned + token-type positions, embedding LayerNorm, post-norm blocks, erf GELU,
bidirectional attention, MLM head (dense, GELU, LayerNorm, output bias) tied to the embedding.
Hugging Face checkpoints come as ``BertForMaskedLM`` / ``BertForPreTraining`` (names under
``bert.``, head under ``cls.predictions.``) or as a bare ``BertModel`` (no prefix, no head).
"""

from __future__ import annotations

import re

from plait.layers.config import TransformerConfig
from plait.models.family import ModelFamily
from plait.models.hf_base import HFClasses, HFLayout, Rule, pairs, require_fields, unsupported

_POSITION_BUFFER = re.compile(
    r"(^|\.)embeddings\.position_ids$"
)  # position-id buffer, not a weight
_HEAD = "cls.predictions."


def bert_config(**overrides) -> TransformerConfig:
    """BERT (Devlin et al., 2019); defaults are BERT-base with its MLM head."""
    base = dict(
        arch="bert",
        vocab_size=30522,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        max_position_embeddings=512,
        activation="gelu",
        norm="layernorm",
        norm_eps=1e-12,
        bias=True,
        tie_embeddings=True,
        causal=False,
        post_norm=True,
        type_vocab_size=2,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        embedding_norm=True,
        head_transform=True,
        head_bias=True,
    )
    return TransformerConfig(**{**base, **overrides})


def _hf_rules(c: TransformerConfig, lay: HFLayout) -> list[Rule]:
    p, L, wb = lay.prefix, c.num_layers, ("weight", "bias")
    e = f"{p}embeddings"
    out = [
        Rule(("layers.0.word_embeddings.weight",), (f"{e}.word_embeddings.weight",)),
        Rule(("layers.0.position_embeddings",), (f"{e}.position_embeddings.weight",)),
    ]
    if c.type_vocab_size:
        out.append(
            Rule(("layers.0.token_type_embeddings",), (f"{e}.token_type_embeddings.weight",))
        )
    out += pairs("layers.0.norm", f"{e}.LayerNorm", wb)
    for i in range(1, L + 1):
        h, a = f"{p}encoder.layer.{i - 1}", f"layers.{i}.attn"
        for proj, name in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            out += pairs(f"{a}.{proj}", f"{h}.attention.self.{name}", wb)
        out += pairs(f"{a}.o_proj", f"{h}.attention.output.dense", wb)
        out += pairs(f"layers.{i}.attn_norm", f"{h}.attention.output.LayerNorm", wb)
        out += pairs(f"layers.{i}.mlp.up_proj", f"{h}.intermediate.dense", wb)
        out += pairs(f"layers.{i}.mlp.down_proj", f"{h}.output.dense", wb)
        out += pairs(f"layers.{i}.mlp_norm", f"{h}.output.LayerNorm", wb)
    if lay.head:
        t = f"layers.{L + 1}"
        out += pairs(f"{t}.dense", f"{_HEAD}transform.dense", wb)
        out += pairs(f"{t}.norm", f"{_HEAD}transform.LayerNorm", wb)
        # The decoder's bias is the same tensor as cls.predictions.bias; some checkpoints hold only it.
        out.append(Rule((f"{t}.bias",), (f"{_HEAD}bias",), aliases=((f"{_HEAD}decoder.bias",),)))
        if not c.tie_embeddings:
            out.append(Rule((f"{t}.weight",), (f"{_HEAD}decoder.weight",)))
    return out


def _config_from_hf(c) -> TransformerConfig:
    mt = c.model_type
    if c.hidden_act != "gelu":
        raise unsupported(mt, f"hidden_act {c.hidden_act!r} (plait's BERT uses erf GELU, 'gelu')")
    if getattr(c, "position_embedding_type", "absolute") != "absolute" or getattr(
        c, "is_decoder", False
    ):
        raise unsupported(mt, "relative position embeddings or is_decoder=True")
    return bert_config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size,
        max_position_embeddings=c.max_position_embeddings,
        norm_eps=float(c.layer_norm_eps),
        type_vocab_size=c.type_vocab_size,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        hidden_dropout=float(c.hidden_dropout_prob),
        attention_dropout=float(c.attention_probs_dropout_prob),
        init_std=float(c.initializer_range),
    )


def _config_to_hf(c: TransformerConfig, extra: dict):
    from transformers import BertConfig

    require_fields(
        c,
        norm="layernorm",
        activation="gelu",
        causal=False,
        post_norm=True,
        bias=True,
        rope_theta=None,
        num_kv_heads=c.num_heads,
        num_experts=0,
        head_dim=c.hidden_size // c.num_heads,
        qk_norm=False,
    )
    return BertConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        intermediate_size=c.ffn_hidden_size,
        hidden_act="gelu",
        hidden_dropout_prob=c.hidden_dropout,
        attention_probs_dropout_prob=c.attention_dropout,
        max_position_embeddings=c.max_position_embeddings,
        type_vocab_size=c.type_vocab_size,
        layer_norm_eps=c.norm_eps,
        initializer_range=c.init_std,
        tie_word_embeddings=c.tie_embeddings,
        **extra,
    )


def _detect_layout(hf: HFClasses, hf_names: set[str]) -> HFLayout:
    """A ``BertModel`` saved alone has no prefix and no head; ``BertForPreTraining``'s next-sentence head
    is kept by the importer as ``hf_extra``."""
    prefix = hf.prefix if any(n.startswith(hf.prefix) for n in hf_names) else ""
    has_head = any(n.startswith(_HEAD) for n in hf_names)
    architecture = hf.head_class if has_head else hf.base_class
    if "cls.seq_relationship.weight" in hf_names:
        architecture = "BertForPreTraining"
    return HFLayout(hf.model_type, architecture, prefix, True)


def _export_layout(hf: HFClasses, config: TransformerConfig, plait_names: set[str]) -> HFLayout:
    """``BertForMaskedLM`` when the checkpoint holds the MLM head, else a bare ``BertModel``."""
    if any(n.startswith(f"layers.{config.num_layers + 1}.") for n in plait_names):
        return HFLayout(hf.model_type, hf.head_class, hf.prefix, True)
    return HFLayout(hf.model_type, hf.base_class, "", False)


FAMILY = ModelFamily(
    name="bert",
    hf=HFClasses("bert", "bert.", "BertModel", "BertForMaskedLM"),
    presets={
        "bert-base": lambda: bert_config(),
        "bert-tiny": lambda: bert_config(
            vocab_size=8192, hidden_size=128, num_layers=4, num_heads=4, max_position_embeddings=256
        ),
    },
    make_config=bert_config,
    hf_rules=_hf_rules,
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
    buffers=_POSITION_BUFFER,
    tied_head=f"{_HEAD}decoder.weight",
    layout_of=_detect_layout,
    export_layout_of=_export_layout,
)
