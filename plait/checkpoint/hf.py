"""Hugging Face <-> plait: parameter names, tensor transforms and configs, dispatched to the model
families of ``plait.models`` (``gpt2``, ``llama``, ``bert``, ``mixtral``, ``qwen3_moe``; one module each).

``rules(config, layout)`` lists the :class:`Rule` s of one architecture and HF layout
(:class:`HFLayout`: model class and name prefix, e.g. ``LlamaForCausalLM`` under ``model.``,
``BertModel`` without prefix); ``to_plait`` / ``to_hf`` apply a rule's transform (the table
``TRANSFORMS`` in ``plait.models.hf_base``). ``config_from_hf`` / ``config_to_hf`` convert
architectures both ways and raise ``ValueError`` naming the unsupported model_type or feature
(rope scaling, another activation, ...).
"""

from __future__ import annotations

from plait.layers.config import TransformerConfig
from plait.models.hf_base import TRANSFORMS, HFLayout, Rule, to_hf, to_plait
from plait.models.hf_sizes import check_hf_sizes
from plait.models.registry import HF_MODEL_TYPES, family_for_model_type, get_family

SUPPORTED_MODEL_TYPES = tuple(HF_MODEL_TYPES)

#: Non-architecture HF config fields carried through a plait checkpoint (``meta["hf"]["config"]``).
CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "unk_token_id")

__all__ = [
    "CARRIED_FIELDS",
    "HFLayout",
    "Rule",
    "SUPPORTED_MODEL_TYPES",
    "TRANSFORMS",
    "alias_names",
    "check_hf_sizes",
    "check_model_type",
    "config_from_hf",
    "config_to_hf",
    "detect_layout",
    "export_layout",
    "ignored_hf_name",
    "rules",
    "to_hf",
    "to_plait",
]


def rules(config: TransformerConfig, layout: HFLayout) -> list[Rule]:
    """Every name rule of ``config``'s architecture in ``layout``."""
    return family_for_model_type(layout.model_type).hf_rules(config, layout)


def alias_names(rule_list: list[Rule]) -> set[str]:
    """Every HF name that some rule of ``rule_list`` accepts as an alias of its own names."""
    return {name for rule in rule_list for alias in rule.aliases for name in alias}


def ignored_hf_name(name: str, config: TransformerConfig) -> bool:
    """True for HF tensors of ``config``'s family that carry nothing to convert: buffers and copies of
    tied weights (an unused alias of a rule's tensor, see :func:`alias_names`, is a copy too)."""
    return get_family(config.arch).hf_ignored(name, config)


def check_model_type(model_type: str) -> None:
    """ValueError naming ``model_type`` and the supported ones unless it is supported."""
    family_for_model_type(model_type)


def detect_layout(model_type: str, hf_names) -> HFLayout:
    """The layout of an HF checkpoint from its tensor names: the class it was saved from (a base
    model saved alone has no name prefix and no head). ``head`` is True: an import looks for the
    head's tensors and reports them missing when absent."""
    return family_for_model_type(model_type).detect_layout(set(hf_names))


def export_layout(config: TransformerConfig, plait_names) -> HFLayout:
    """The HF layout ``to_hf`` writes: the LM class (``LlamaForCausalLM``, ``GPT2LMHeadModel``),
    and for BERT ``BertForMaskedLM`` when the checkpoint holds the MLM head, else ``BertModel``."""
    return get_family(config.arch).export_layout(config, set(plait_names))


def _as_config(hf_config):
    if isinstance(hf_config, dict):
        from transformers import AutoConfig

        d = dict(hf_config)
        model_type = d.pop("model_type", None)
        check_model_type(model_type)
        return AutoConfig.for_model(model_type, **d)
    check_model_type(getattr(hf_config, "model_type", None))
    return hf_config


def config_from_hf(hf_config) -> TransformerConfig:
    """A ``TransformerConfig`` from an HF ``PretrainedConfig`` (or its dict, e.g. a parsed config.json).

    Raises:
        ValueError: unsupported model_type (names the supported ones) or an architecture feature
            plait does not implement (rope scaling, head_dim != hidden/heads, other activations,
            unequal attention/MLP biases, relative positions, decoder BERT).
    """
    c = _as_config(hf_config)
    return family_for_model_type(c.model_type).config_from_hf(c)


def config_to_hf(config: TransformerConfig, carried: dict | None = None):
    """The HF ``PretrainedConfig`` (``LlamaConfig``, ``GPT2Config``, ``BertConfig``) of ``config``.

    ``carried``: extra fields such as token ids (see :data:`CARRIED_FIELDS`) to set as well.

    Raises:
        ValueError: the plait config uses a combination the HF class cannot express (names it).
    """
    extra = {k: v for k, v in (carried or {}).items() if k in CARRIED_FIELDS}
    return get_family(config.arch).config_to_hf(config, extra)
