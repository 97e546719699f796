"""The model-family registry: arch name -> :class:`~plait.models.family.ModelFamily`, and the presets
of every family.

Adding a family (e.g. Mistral) means writing ``plait/models/mistral.py`` with a ``FAMILY = ModelFamily(...)``
and adding that object to :data:`FAMILIES` here.
"""

from __future__ import annotations

from plait.layers.config import TransformerConfig
from plait.models import bert, gpt2, llama, mixtral, qwen3_moe
from plait.models.family import ModelFamily

#: arch name -> family (constant).
FAMILIES: dict[str, ModelFamily] = {
    f.name: f for f in (llama.FAMILY, gpt2.FAMILY, bert.FAMILY, mixtral.FAMILY, qwen3_moe.FAMILY)
}
#: The arch names ``TransformerConfig.arch`` accepts.
ARCHES = tuple(FAMILIES)
#: Hugging Face model_type -> family (constant).
HF_MODEL_TYPES: dict[str, ModelFamily] = {f.hf.model_type: f for f in FAMILIES.values()}
#: Preset name -> zero-argument config factory, over all families (constant).
PRESETS = {name: make for f in FAMILIES.values() for name, make in f.presets.items()}


def get_family(arch: str) -> ModelFamily:
    """The family registered as ``arch`` (ValueError listing the known arch names otherwise)."""
    if arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; use one of {ARCHES}")
    return FAMILIES[arch]


def family_for_model_type(model_type: str) -> ModelFamily:
    """The family converting Hugging Face ``model_type`` (ValueError naming the supported ones)."""
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"Hugging Face model_type {model_type!r} is not supported by plait's converter; "
            f"supported: {list(HF_MODEL_TYPES)}"
        )
    return HF_MODEL_TYPES[model_type]


def preset(name: str, **overrides) -> TransformerConfig:
    """A named preset with optional overrides; ValueError listing the names for an unknown one."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]().replace(**overrides) if overrides else PRESETS[name]()
