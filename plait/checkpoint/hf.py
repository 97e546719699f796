"""Hugging Face <-> plait: parameter names, tensor transforms and configs for Llama, GPT-2 and BERT.

A :class:`Rule` pairs one or more plait logical tensors with one or more Hugging Face tensors and
says how values move between them (``copy``; ``transpose`` for GPT-2's ``Conv1D`` weights, which
are stored ``[in, out]``; ``qkv_conv1d`` / ``qkv_bias`` for GPT-2's fused ``c_attn``, stored
``[h, 3h]`` with q, k, v side by side along the output dim). ``rules(config, layout)`` lists the
rules of one architecture and HF layout (:class:`HFLayout`: model class and name prefix, e.g.
``LlamaForCausalLM`` under ``model.``, ``BertModel`` without prefix).

Llama's q/k projections need no permutation: Hugging Face's ``LlamaForCausalLM`` applies RoPE in
the rotate-half layout, as ``plait.layers.rope`` does (the GGUF files of llama.cpp use the
interleaved layout; transformers un-permutes them when it loads one). The SmolLM2 parity test in
``tests/test_convert_hf.py`` checks this numerically.

``config_from_hf`` / ``config_to_hf`` convert architectures both ways and raise ``ValueError``
naming the unsupported model_type or feature (rope scaling, another activation, ...).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from plait.layers.config import TransformerConfig, bert_config, gpt2_config, llama_config

SUPPORTED_MODEL_TYPES = ("llama", "gpt2", "bert")

#: HF tensors that are buffers or duplicates of tied weights, never converted.
_IGNORED = (re.compile(r"(^|\.)h\.\d+\.attn\.(masked_)?bias$"),        # GPT-2 causal-mask buffers
            re.compile(r"(^|\.)embeddings\.position_ids$"),             # BERT position-id buffer
            re.compile(r"(^|\.)rotary_emb\.inv_freq$"))                 # old Llama RoPE buffer


@dataclass(frozen=True)
class Rule:
    """``plait`` tensors <-> ``hf`` tensors through transform ``kind``."""

    plait: tuple[str, ...]
    hf: tuple[str, ...]
    kind: str = "copy"


@dataclass(frozen=True)
class HFLayout:
    """Where an architecture's tensors live in a Hugging Face checkpoint.

    ``architecture``: the model class (``config.architectures[0]``); ``prefix``: prefix of the
    base model's names (``"model."``, ``"transformer."``, ``"bert."`` or ``""``); ``head``: the
    rules include BERT's MLM head (``cls.predictions.*``). Decoders' untied ``lm_head.weight`` is
    in the rules whenever the config is untied.
    """

    model_type: str
    architecture: str
    prefix: str
    head: bool


# ------------------------------------------------------------------------------------- tensor transforms
def to_plait(kind: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF tensors of a rule -> its plait tensors."""
    if kind == "copy":
        return list(tensors)
    if kind == "transpose":
        return [tensors[0].t().contiguous()]
    if kind == "qkv_conv1d":          # [h_in, 3 h_out] -> 3 x [h_out, h_in]
        return [t.t().contiguous() for t in tensors[0].chunk(3, dim=1)]
    if kind == "qkv_bias":            # [3 h] -> 3 x [h]
        return [t.contiguous() for t in tensors[0].chunk(3, dim=0)]
    raise ValueError(f"unknown rule kind {kind!r}")


def to_hf(kind: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """plait tensors of a rule -> its HF tensors (inverse of ``to_plait``)."""
    if kind == "copy":
        return list(tensors)
    if kind == "transpose":
        return [tensors[0].t().contiguous()]
    if kind == "qkv_conv1d":
        return [torch.cat([t.t() for t in tensors], dim=1).contiguous()]
    if kind == "qkv_bias":
        return [torch.cat(tensors, dim=0)]
    raise ValueError(f"unknown rule kind {kind!r}")


# ------------------------------------------------------------------------------------- name rules
def _pairs(plait: str, hf: str, names, kind: str = "copy") -> list[Rule]:
    return [Rule((f"{plait}.{n}",), (f"{hf}.{n}",), kind) for n in names]


def _llama_rules(c: TransformerConfig, lay: HFLayout) -> list[Rule]:
    p, L, wb = lay.prefix, c.num_layers, ("weight", "bias") if c.bias else ("weight",)
    out = [Rule(("layers.0.word_embeddings.weight",), (f"{p}embed_tokens.weight",))]
    for i in range(1, L + 1):
        h = f"{p}layers.{i - 1}"
        out += _pairs(f"layers.{i}.attn_norm", f"{h}.input_layernorm", ("weight",))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out += _pairs(f"layers.{i}.attn.{proj}", f"{h}.self_attn.{proj}", wb)
        out += _pairs(f"layers.{i}.mlp_norm", f"{h}.post_attention_layernorm", ("weight",))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out += _pairs(f"layers.{i}.mlp.{proj}", f"{h}.mlp.{proj}", wb)
    out += _pairs(f"layers.{L + 1}.norm", f"{p}norm", ("weight",))
    if not c.tie_embeddings:
        out.append(Rule((f"layers.{L + 1}.weight",), ("lm_head.weight",)))
    return out


def _gpt2_rules(c: TransformerConfig, lay: HFLayout) -> list[Rule]:
    p, L, wb = lay.prefix, c.num_layers, ("weight", "bias")
    out = [Rule(("layers.0.word_embeddings.weight",), (f"{p}wte.weight",)),
           Rule(("layers.0.position_embeddings",), (f"{p}wpe.weight",))]
    for i in range(1, L + 1):
        h, a = f"{p}h.{i - 1}", f"layers.{i}.attn"
        out += _pairs(f"layers.{i}.attn_norm", f"{h}.ln_1", wb)
        out.append(Rule((f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"),
                        (f"{h}.attn.c_attn.weight",), "qkv_conv1d"))
        out.append(Rule((f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"),
                        (f"{h}.attn.c_attn.bias",), "qkv_bias"))
        out += _pairs(f"{a}.o_proj", f"{h}.attn.c_proj", ("weight",), "transpose")
        out += _pairs(f"{a}.o_proj", f"{h}.attn.c_proj", ("bias",))
        out += _pairs(f"layers.{i}.mlp_norm", f"{h}.ln_2", wb)
        out += _pairs(f"layers.{i}.mlp.up_proj", f"{h}.mlp.c_fc", ("weight",), "transpose")
        out += _pairs(f"layers.{i}.mlp.up_proj", f"{h}.mlp.c_fc", ("bias",))
        out += _pairs(f"layers.{i}.mlp.down_proj", f"{h}.mlp.c_proj", ("weight",), "transpose")
        out += _pairs(f"layers.{i}.mlp.down_proj", f"{h}.mlp.c_proj", ("bias",))
    out += _pairs(f"layers.{L + 1}.norm", f"{p}ln_f", wb)
    if not c.tie_embeddings:
        out.append(Rule((f"layers.{L + 1}.weight",), ("lm_head.weight",)))
    return out


def _bert_rules(c: TransformerConfig, lay: HFLayout) -> list[Rule]:
    p, L, wb = lay.prefix, c.num_layers, ("weight", "bias")
    e = f"{p}embeddings"
    out = [Rule(("layers.0.word_embeddings.weight",), (f"{e}.word_embeddings.weight",)),
           Rule(("layers.0.position_embeddings",), (f"{e}.position_embeddings.weight",))]
    if c.type_vocab_size:
        out.append(Rule(("layers.0.token_type_embeddings",), (f"{e}.token_type_embeddings.weight",)))
    out += _pairs("layers.0.norm", f"{e}.LayerNorm", wb)
    for i in range(1, L + 1):
        h, a = f"{p}encoder.layer.{i - 1}", f"layers.{i}.attn"
        for proj, name in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            out += _pairs(f"{a}.{proj}", f"{h}.attention.self.{name}", wb)
        out += _pairs(f"{a}.o_proj", f"{h}.attention.output.dense", wb)
        out += _pairs(f"layers.{i}.attn_norm", f"{h}.attention.output.LayerNorm", wb)
        out += _pairs(f"layers.{i}.mlp.up_proj", f"{h}.intermediate.dense", wb)
        out += _pairs(f"layers.{i}.mlp.down_proj", f"{h}.output.dense", wb)
        out += _pairs(f"layers.{i}.mlp_norm", f"{h}.output.LayerNorm", wb)
    if lay.head:
        t = f"layers.{L + 1}"
        out += _pairs(f"{t}.dense", "cls.predictions.transform.dense", wb)
        out += _pairs(f"{t}.norm", "cls.predictions.transform.LayerNorm", wb)
        out.append(Rule((f"{t}.bias",), ("cls.predictions.bias",)))
        if not c.tie_embeddings:
            out.append(Rule((f"{t}.weight",), ("cls.predictions.decoder.weight",)))
    return out


_RULES = {"llama": _llama_rules, "gpt2": _gpt2_rules, "bert": _bert_rules}


def rules(config: TransformerConfig, layout: HFLayout) -> list[Rule]:
    """Every name rule of ``config``'s architecture in ``layout``."""
    return _RULES[layout.model_type](config, layout)


def ignored_hf_name(name: str, config: TransformerConfig) -> bool:
    """True for HF tensors that carry nothing to convert: buffers and copies of tied weights."""
    if any(p.search(name) for p in _IGNORED):
        return True
    if name == "cls.predictions.decoder.bias":          # an alias of cls.predictions.bias
        return True
    tied = ("lm_head.weight", "cls.predictions.decoder.weight")
    return config.tie_embeddings and name in tied


# ------------------------------------------------------------------------------------- layouts
_BASE = {"llama": ("model.", "LlamaModel", "LlamaForCausalLM"),
         "gpt2": ("transformer.", "GPT2Model", "GPT2LMHeadModel"),
         "bert": ("bert.", "BertModel", "BertForMaskedLM")}


def detect_layout(model_type: str, hf_names) -> HFLayout:
    """The layout of an HF checkpoint from its tensor names: the class it was saved from (a base
    model saved alone has no name prefix and no head). ``head`` is True: an import looks for the
    head's tensors and reports them missing when absent."""
    check_model_type(model_type)
    prefix, base_cls, head_cls = _BASE[model_type]
    names = set(hf_names)
    prefix = prefix if any(n.startswith(prefix) for n in names) else ""
    if model_type == "bert":
        has_head = any(n.startswith("cls.predictions.") for n in names)
    else:
        has_head = bool(prefix) or "lm_head.weight" in names
    architecture = head_cls if has_head else base_cls
    if model_type == "bert" and "cls.seq_relationship.weight" in names:
        architecture = "BertForPreTraining"     # its next-sentence head is kept as hf_extra
    return HFLayout(model_type, architecture, prefix, True)


def export_layout(config: TransformerConfig, plait_names) -> HFLayout:
    """The HF layout ``to_hf`` writes: the LM class (``LlamaForCausalLM``, ``GPT2LMHeadModel``),
    and for BERT ``BertForMaskedLM`` when the checkpoint holds the MLM head, else ``BertModel``."""
    prefix, base_cls, head_cls = _BASE[config.arch]
    if config.arch == "bert":
        head = any(n.startswith(f"layers.{config.num_layers + 1}.") for n in plait_names)
        return HFLayout("bert", head_cls, prefix, True) if head else HFLayout("bert", base_cls, "", False)
    return HFLayout(config.arch, head_cls, prefix, not config.tie_embeddings)


# ------------------------------------------------------------------------------------- configs
def check_model_type(model_type: str) -> None:
    """ValueError naming ``model_type`` and the supported ones unless it is supported."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"Hugging Face model_type {model_type!r} is not supported by plait's converter; "
                         f"supported: {list(SUPPORTED_MODEL_TYPES)}")


def _as_config(hf_config):
    if isinstance(hf_config, dict):
        from transformers import AutoConfig

        d = dict(hf_config)
        model_type = d.pop("model_type", None)
        check_model_type(model_type)
        return AutoConfig.for_model(model_type, **d)
    check_model_type(getattr(hf_config, "model_type", None))
    return hf_config


def _unsupported(model_type: str, what: str) -> ValueError:
    return ValueError(f"Hugging Face {model_type} config: {what} is not supported by plait")


def _rope_theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise _unsupported("llama", f"rope scaling {params!r} (plait implements plain RoPE)")
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


_GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(hf_config) -> TransformerConfig:
    """A ``TransformerConfig`` from an HF ``PretrainedConfig`` (or its dict, e.g. a parsed config.json).

    Raises:
        ValueError: unsupported model_type (names the supported ones) or an architecture feature
            plait does not implement (rope scaling, head_dim != hidden/heads, other activations,
            unequal attention/MLP biases, relative positions, decoder BERT).
    """
    c = _as_config(hf_config)
    mt = c.model_type
    if mt == "llama":
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None)
        if head_dim not in (None, c.hidden_size // heads):
            raise _unsupported(mt, f"head_dim {head_dim} != hidden_size/num_attention_heads "
                                   f"({c.hidden_size}/{heads})")
        if c.hidden_act != "silu":
            raise _unsupported(mt, f"hidden_act {c.hidden_act!r} (plait's Llama MLP is SwiGLU with silu)")
        attn_bias, mlp_bias = bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))
        if attn_bias != mlp_bias:
            raise _unsupported(mt, f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (plait has one bias flag)")
        return llama_config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                            num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                            ffn_hidden_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
                            norm_eps=float(c.rms_norm_eps), rope_theta=_rope_theta(c), bias=attn_bias,
                            tie_embeddings=bool(c.tie_word_embeddings),
                            attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
                            hidden_dropout=0.0, init_std=float(c.initializer_range))
    if mt == "gpt2":
        if c.activation_function not in _GELU:
            raise _unsupported(mt, f"activation_function {c.activation_function!r}; use one of {sorted(_GELU)}")
        if not c.scale_attn_weights or c.scale_attn_by_inverse_layer_idx or getattr(c, "add_cross_attention", False):
            raise _unsupported(mt, "scale_attn_weights=False, scale_attn_by_inverse_layer_idx or cross-attention")
        return gpt2_config(vocab_size=c.vocab_size, hidden_size=c.n_embd, num_layers=c.n_layer, num_heads=c.n_head,
                           ffn_hidden_size=c.n_inner or 4 * c.n_embd, max_position_embeddings=c.n_positions,
                           activation=_GELU[c.activation_function], norm_eps=float(c.layer_norm_epsilon),
                           tie_embeddings=bool(c.tie_word_embeddings), hidden_dropout=float(c.resid_pdrop),
                           attention_dropout=float(c.attn_pdrop), init_std=float(c.initializer_range))
    # bert
    if c.hidden_act != "gelu":
        raise _unsupported(mt, f"hidden_act {c.hidden_act!r} (plait's BERT uses erf GELU, 'gelu')")
    if getattr(c, "position_embedding_type", "absolute") != "absolute" or getattr(c, "is_decoder", False):
        raise _unsupported(mt, "relative position embeddings or is_decoder=True")
    return bert_config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                       num_heads=c.num_attention_heads, ffn_hidden_size=c.intermediate_size,
                       max_position_embeddings=c.max_position_embeddings, norm_eps=float(c.layer_norm_eps),
                       type_vocab_size=c.type_vocab_size, tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
                       hidden_dropout=float(c.hidden_dropout_prob),
                       attention_dropout=float(c.attention_probs_dropout_prob), init_std=float(c.initializer_range))


#: Non-architecture HF config fields carried through a plait checkpoint (``meta["hf"]["config"]``).
CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "unk_token_id")


def _require(config: TransformerConfig, **want) -> None:
    bad = {k: getattr(config, k) for k, v in want.items() if getattr(config, k) != v}
    if bad:
        raise ValueError(f"plait {config.arch} config cannot be written as a Hugging Face {config.arch} model: "
                         f"it has {bad}, Hugging Face needs {({k: want[k] for k in bad})}")


def config_to_hf(config: TransformerConfig, carried: dict | None = None):
    """The HF ``PretrainedConfig`` (``LlamaConfig``, ``GPT2Config``, ``BertConfig``) of ``config``.

    ``carried``: extra fields such as token ids (see :data:`CARRIED_FIELDS`) to set as well.

    Raises:
        ValueError: the plait config uses a combination the HF class cannot express (names it).
    """
    from transformers import BertConfig, GPT2Config, LlamaConfig

    c, extra = config, {k: v for k, v in (carried or {}).items() if k in CARRIED_FIELDS}
    if c.arch == "llama":
        _require(c, norm="rmsnorm", activation="swiglu", causal=True, post_norm=False, type_vocab_size=0)
        if c.rope_theta is None:
            raise ValueError("plait llama config without rope_theta cannot be written as Hugging Face Llama")
        return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                           num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                           num_key_value_heads=c.num_kv_heads, max_position_embeddings=c.max_position_embeddings,
                           rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings,
                           hidden_act="silu", attention_bias=c.bias, mlp_bias=c.bias, head_dim=c.head_dim,
                           attention_dropout=c.attention_dropout, initializer_range=c.init_std, **extra)
    if c.arch == "gpt2":
        _require(c, norm="layernorm", causal=True, post_norm=False, bias=True, type_vocab_size=0,
                 rope_theta=None, num_kv_heads=c.num_heads)
        act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}.get(c.activation)
        if act is None:
            raise ValueError(f"plait gpt2 activation {c.activation!r} has no Hugging Face GPT-2 equivalent")
        return GPT2Config(vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size,
                          n_layer=c.num_layers, n_head=c.num_heads,
                          n_inner=None if c.ffn_hidden_size == 4 * c.hidden_size else c.ffn_hidden_size,
                          activation_function=act, layer_norm_epsilon=c.norm_eps, resid_pdrop=c.hidden_dropout,
                          embd_pdrop=c.hidden_dropout, attn_pdrop=c.attention_dropout,
                          initializer_range=c.init_std, tie_word_embeddings=c.tie_embeddings, **extra)
    _require(c, norm="layernorm", activation="gelu", causal=False, post_norm=True, bias=True, rope_theta=None,
             num_kv_heads=c.num_heads)
    return BertConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                      num_attention_heads=c.num_heads, intermediate_size=c.ffn_hidden_size, hidden_act="gelu",
                      hidden_dropout_prob=c.hidden_dropout, attention_probs_dropout_prob=c.attention_dropout,
                      max_position_embeddings=c.max_position_embeddings, type_vocab_size=c.type_vocab_size,
                      layer_norm_eps=c.norm_eps, initializer_range=c.init_std,
                      tie_word_embeddings=c.tie_embeddings, **extra)
