"""Model families: one module per architecture (``gpt2``, ``llama``, ``bert``, ``mixtral``, ``qwen3_moe``)
holding its presets (the ``TransformerConfig`` fields the shared layers build from), its Hugging Face name
rules and HF config mapping.

The families build on ``plait.layers`` (which never imports them) and serve ``plait.checkpoint`` (the
converter reads their HF rules).
``registry`` finds a family by arch name (``get_family``) or HF model_type; ``family`` defines
the :class:`ModelFamily` record a new family module fills in.
"""

from plait.models.bert import bert_config
from plait.models.family import ModelFamily
from plait.models.gpt2 import gpt2_config
from plait.models.llama import llama_config
from plait.models.mixtral import mixtral_config
from plait.models.qwen3_moe import qwen3_moe_config
from plait.models.registry import (
    ARCHES,
    FAMILIES,
    PRESETS,
    family_for_model_type,
    get_family,
    preset,
)

__all__ = [
    "ARCHES",
    "FAMILIES",
    "ModelFamily",
    "PRESETS",
    "bert_config",
    "family_for_model_type",
    "get_family",
    "gpt2_config",
    "llama_config",
    "mixtral_config",
    "preset",
    "qwen3_moe_config",
]
