"""Hugging Face name rules shared by every model family: :class:`Rule`, :class:`HFLayout` and the
tensor transforms of :data:`TRANSFORMS`.

A :class:`Rule` pairs one or more plait logical tensors with one or more Hugging Face tensors and
names the transform between them (``kind``, a key of :data:`TRANSFORMS`): ``copy``; ``transpose``
for GPT-2's ``Conv1D`` weights, stored ``[in, out]``; ``qkv_conv1d`` / ``qkv_bias`` for GPT-2's
fused ``c_attn``, stored ``[h, 3h]`` with q, k, v side by side along the output dim; ``stack`` /
``stack_pair`` / ``gate_up`` for a mixture of experts' weights, which hub checkpoints store one
``Linear`` per expert and transformers 5 holds stacked (``[E, 2 ffn, h]`` gate and up fused).

Imports only torch: the family modules (``plait.models.gpt2`` etc.) and ``plait.checkpoint.hf``
both build on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

Tensors = Sequence[torch.Tensor]


#: RoPE's ``inv_freq`` buffer, saved by older transformers under this name: not a weight (nothing to convert).
ROPE_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Rule:
    """``plait`` tensors <-> ``hf`` tensors through transform ``kind``.

    ``aliases``: other HF name tuples that hold the same values in some checkpoints (e.g. BERT's
    ``cls.predictions.decoder.bias`` for ``cls.predictions.bias``); an import reads the first
    alias present when ``hf`` is absent, and treats an unused alias as a duplicate to ignore.
    ``alias_kinds``: the transform of each alias, in order, where it differs from ``kind`` (e.g. a
    mixture of experts' fused ``experts.gate_up_proj`` for the per-expert ``w1``/``w3``); an alias
    without one uses ``kind``. An export always writes ``hf`` through ``kind``.
    """

    plait: tuple[str, ...]
    hf: tuple[str, ...]
    kind: str = "copy"
    aliases: tuple[tuple[str, ...], ...] = ()
    alias_kinds: tuple[str, ...] = ()

    def sources(self) -> list[tuple[tuple[str, ...], str]]:
        """``(hf names, kind)`` of ``hf`` and then of each alias, in the order an import tries them."""
        kinds = (self.kind, *self.alias_kinds, *(self.kind,) * len(self.aliases))
        return list(zip((self.hf, *self.aliases), kinds))


@dataclass(frozen=True)
class HFLayout:
    """Where an architecture's tensors live in a Hugging Face checkpoint.

    ``model_type``: HF ``config.model_type``; ``architecture``: the model class
    (``config.architectures[0]``); ``prefix``: prefix of the base model's names (``"model."``,
    ``"transformer."``, ``"bert."`` or ``""``); ``head``: the rules include BERT's MLM head
    (``cls.predictions.*``). Decoders' untied ``lm_head.weight`` is in the rules whenever the
    config is untied.
    """

    model_type: str
    architecture: str
    prefix: str
    head: bool


@dataclass(frozen=True)
class HFClasses:
    """A family's Hugging Face model classes: ``model_type``; ``prefix`` of the base model's tensor
    names inside the head class; ``base_class`` (no head, saved without prefix) and ``head_class``."""

    model_type: str
    prefix: str
    base_class: str
    head_class: str


# ------------------------------------------------------------------------------------- tensor transforms
def _copy(tensors: Tensors) -> list[torch.Tensor]:
    return list(tensors)


def _transpose(tensors: Tensors) -> list[torch.Tensor]:
    return [tensors[0].t().contiguous()]


def _split_qkv_conv1d(tensors: Tensors) -> list[torch.Tensor]:
    """``[h_in, 3 h_out]`` -> 3 x ``[h_out, h_in]``."""
    return [t.t().contiguous() for t in tensors[0].chunk(3, dim=1)]


def _fuse_qkv_conv1d(tensors: Tensors) -> list[torch.Tensor]:
    """3 x ``[h_out, h_in]`` -> ``[h_in, 3 h_out]``."""
    return [torch.cat([t.t() for t in tensors], dim=1).contiguous()]


def _split_qkv_bias(tensors: Tensors) -> list[torch.Tensor]:
    """``[3 h]`` -> 3 x ``[h]``."""
    return [t.contiguous() for t in tensors[0].chunk(3, dim=0)]


def _fuse_qkv_bias(tensors: Tensors) -> list[torch.Tensor]:
    """3 x ``[h]`` -> ``[3 h]``."""
    return [torch.cat(list(tensors), dim=0)]


def _stack(tensors: Tensors) -> list[torch.Tensor]:
    """E x ``[out, in]`` (one ``Linear`` weight per expert) -> ``[E, out, in]``."""
    return [torch.stack(list(tensors))]


def _unstack(tensors: Tensors) -> list[torch.Tensor]:
    """``[E, out, in]`` -> E x ``[out, in]``."""
    return list(tensors[0].unbind(0))


def _stack_pair(tensors: Tensors) -> list[torch.Tensor]:
    """2E tensors ``[out, in]`` (E of the first kind, then E of the second) -> 2 x ``[E, out, in]``."""
    if len(tensors) % 2:
        raise ValueError(
            f"stack_pair needs an even number of tensors (E of each of two kinds), got {len(tensors)}"
        )
    half = len(tensors) // 2
    return [torch.stack(list(tensors[:half])), torch.stack(list(tensors[half:]))]


def _unstack_pair(tensors: Tensors) -> list[torch.Tensor]:
    """2 x ``[E, out, in]`` -> 2E tensors ``[out, in]``, the first's experts then the second's."""
    return [*tensors[0].unbind(0), *tensors[1].unbind(0)]


def _split_gate_up(tensors: Tensors) -> list[torch.Tensor]:
    """``[E, 2 ffn, h]`` (gate rows, then up rows, per expert: transformers 5's ``experts.gate_up_proj``)
    -> gate ``[E, ffn, h]``, up ``[E, ffn, h]``."""
    return [t.contiguous() for t in tensors[0].chunk(2, dim=1)]


def _fuse_gate_up(tensors: Tensors) -> list[torch.Tensor]:
    """gate, up ``[E, ffn, h]`` -> ``[E, 2 ffn, h]``."""
    return [torch.cat(list(tensors), dim=1)]


Transform = Callable[[Tensors], list]

#: Rule kind -> (HF tensors -> plait tensors, plait tensors -> HF tensors); the two are inverses.
TRANSFORMS: dict[str, tuple[Transform, Transform]] = {
    "copy": (_copy, _copy),
    "transpose": (_transpose, _transpose),
    "qkv_conv1d": (_split_qkv_conv1d, _fuse_qkv_conv1d),
    "qkv_bias": (_split_qkv_bias, _fuse_qkv_bias),
    "stack": (_stack, _unstack),
    "stack_pair": (_stack_pair, _unstack_pair),
    "gate_up": (_split_gate_up, _fuse_gate_up),
}


def _transform(kind: str, direction: int) -> Transform:
    if kind not in TRANSFORMS:
        raise ValueError(f"unknown rule kind {kind!r}; known: {sorted(TRANSFORMS)}")
    return TRANSFORMS[kind][direction]


def to_plait(kind: str, tensors: Tensors) -> list[torch.Tensor]:
    """HF tensors of a rule -> its plait tensors (ValueError for an unknown ``kind``)."""
    return _transform(kind, 0)(tensors)


def to_hf(kind: str, tensors: Tensors) -> list[torch.Tensor]:
    """plait tensors of a rule -> its HF tensors (inverse of ``to_plait``)."""
    return _transform(kind, 1)(tensors)


# ------------------------------------------------------------------------------------- helpers for families
def pairs(plait: str, hf: str, names: Sequence[str], kind: str = "copy") -> list[Rule]:
    """One rule per suffix: ``<plait>.<n>`` <-> ``<hf>.<n>`` for each ``n`` in ``names``."""
    return [Rule((f"{plait}.{n}",), (f"{hf}.{n}",), kind) for n in names]


def decoder_layout(classes: HFClasses, hf_names: set[str]) -> HFLayout:
    """Layout of a decoder checkpoint: the head class when saved with the prefix or an ``lm_head``,
    else the base class; the prefix only when the names carry it."""
    prefix = classes.prefix if any(n.startswith(classes.prefix) for n in hf_names) else ""
    has_head = bool(prefix) or "lm_head.weight" in hf_names
    return HFLayout(
        classes.model_type, classes.head_class if has_head else classes.base_class, prefix, True
    )


def decoder_export_layout(classes: HFClasses, config, plait_names: set[str]) -> HFLayout:
    """Layout a decoder export writes: the head class with the prefix; ``lm_head`` stored unless tied."""
    return HFLayout(
        classes.model_type, classes.head_class, classes.prefix, not config.tie_embeddings
    )


def unsupported(model_type: str, what: str) -> ValueError:
    """The error for an HF config feature plait does not implement."""
    return ValueError(f"Hugging Face {model_type} config: {what} is not supported by plait")


def require_fields(config, **want) -> None:
    """ValueError naming the fields of ``config`` that differ from ``want`` (what HF can express)."""
    bad = {k: getattr(config, k) for k, v in want.items() if getattr(config, k) != v}
    if bad:
        raise ValueError(
            f"plait {config.arch} config cannot be written as a Hugging Face {config.arch} model: "
            f"it has {bad}, Hugging Face needs { ({k: want[k] for k in bad}) }"
        )


def rope_theta_of(c, model_type: str) -> float:
    """RoPE base of HF config ``c`` (``rope_parameters`` in transformers 5, ``rope_theta`` before; default
    10000). Raises ValueError (:func:`unsupported`) for any rope scaling: plait implements plain RoPE."""
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise unsupported(model_type, f"rope scaling {params!r} (plait implements plain RoPE)")
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def decoder_rules(c, lay: HFLayout, layer_rules: Callable[[str, str], list[Rule]]) -> list[Rule]:
    """Rules of a Llama-style decoder without biases (``embed_tokens``; per layer ``input_layernorm``,
    ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``; the final ``norm``; ``lm_head`` unless
    tied), plus ``layer_rules(plait prefix, hf prefix)`` for each layer's other tensors (e.g. its MLP's):
    plait's ``layers.{i}`` is HF's ``<prefix>layers.{i - 1}``."""
    p, L = lay.prefix, c.num_layers
    out = [Rule(("layers.0.word_embeddings.weight",), (f"{p}embed_tokens.weight",))]
    for i in range(1, L + 1):
        h = f"{p}layers.{i - 1}"
        out += pairs(f"layers.{i}.attn_norm", f"{h}.input_layernorm", ("weight",))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out += pairs(f"layers.{i}.attn.{proj}", f"{h}.self_attn.{proj}", ("weight",))
        out += pairs(f"layers.{i}.mlp_norm", f"{h}.post_attention_layernorm", ("weight",))
        out += layer_rules(f"layers.{i}", h)
    out += pairs(f"layers.{L + 1}.norm", f"{p}norm", ("weight",))
    if not c.tie_embeddings:
        out.append(Rule((f"layers.{L + 1}.weight",), ("lm_head.weight",)))
    return out


def expert_rules(
    plait: str, per_expert: str, names: tuple[str, str, str], fused: str, num_experts: int
) -> list[Rule]:
    """Rules of a mixture of experts' stacked weights ``<plait>.gate_proj``, ``.up_proj`` ``[E, ffn, h]`` and
    ``.down_proj`` ``[E, h, ffn]`` (``plait.layers.MoE``).

    Written, and read, as one ``Linear`` per expert, ``<per_expert>.{j}.<name>.weight`` with the gate, up
    and down ``names`` (the hub layout, which transformers 5's ``save_pretrained`` writes too); also read
    from transformers 5's in-memory layout, ``<fused>.gate_up_proj`` ``[E, 2 ffn, h]`` (gate rows first)
    and ``<fused>.down_proj`` ``[E, h, ffn]``.
    """
    gate, up, down = ([f"{per_expert}.{j}.{n}.weight" for j in range(num_experts)] for n in names)
    return [
        Rule(
            (f"{plait}.gate_proj", f"{plait}.up_proj"),
            tuple(gate + up),
            "stack_pair",
            aliases=((f"{fused}.gate_up_proj",),),
            alias_kinds=("gate_up",),
        ),
        Rule(
            (f"{plait}.down_proj",),
            tuple(down),
            "stack",
            aliases=((f"{fused}.down_proj",),),
            alias_kinds=("copy",),
        ),
    ]


def moe_config_fields(c, model_type: str) -> dict:
    """The ``TransformerConfig`` fields shared by HF's Llama-style MoE decoders (Mixtral, Qwen3-MoE) from
    HF config ``c``: sizes, norm epsilon, RoPE base, tying, top-k (``num_experts_per_tok``) and the balance
    loss coefficient (``router_aux_loss_coef``).

    Raises:
        ValueError (:func:`unsupported`): ``hidden_act`` other than silu, a ``sliding_window``, rope scaling.
    """
    if c.hidden_act != "silu":
        raise unsupported(
            model_type, f"hidden_act {c.hidden_act!r} (plait's experts are SwiGLU with silu)"
        )
    if getattr(c, "sliding_window", None) is not None:
        raise unsupported(
            model_type,
            f"sliding_window {c.sliding_window} (plait attends to the whole causal "
            f"context; set sliding_window to null)",
        )
    heads = c.num_attention_heads
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        max_position_embeddings=c.max_position_embeddings,
        norm_eps=float(c.rms_norm_eps),
        rope_theta=rope_theta_of(c, model_type),
        tie_embeddings=bool(c.tie_word_embeddings),
        attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        init_std=float(c.initializer_range),
        moe_top_k=c.num_experts_per_tok,
        moe_balance_loss_coef=float(c.router_aux_loss_coef),
    )


def require_moe_export(c, **want) -> None:
    """ValueError unless plait config ``c`` is a Llama-style MoE decoder Hugging Face's Mixtral / Qwen3-MoE
    classes compute (RMSNorm, SwiGLU experts, causal, no biases, softmax-then-top-k dropless routing without
    shared experts or a selection bias, RoPE), with the family's own fields ``want`` besides."""
    require_fields(
        c,
        norm="rmsnorm",
        activation="swiglu",
        causal=True,
        post_norm=False,
        type_vocab_size=0,
        bias=False,
        moe_router_order="softmax_topk",
        moe_capacity_factor=None,
        moe_shared_ffn_hidden_size=0,
        moe_bias_update_rate=0.0,
        **want,
    )
    if c.num_experts < 1 or c.rope_theta is None:
        raise ValueError(
            f"plait {c.arch} config with num_experts={c.num_experts}, rope_theta={c.rope_theta} "
            f"cannot be written as Hugging Face {c.arch}: it needs num_experts >= 1 and RoPE"
        )
