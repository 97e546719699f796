"""What a model family (GPT-2, Llama, BERT, ...) provides: the :class:`ModelFamily` protocol and
the :class:`Wiring` flags the shared layers read.

A family is one module of ``plait.models`` holding everything about one architecture: its
presets, its wiring, its Hugging Face name rules and its HF config mapping. The registry
(``plait.models.registry``) finds it by its arch name (``TransformerConfig.arch``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:
    from plait.layers.config import TransformerConfig
    from plait.models.hf_base import HFClasses, HFLayout, Rule


@dataclass(frozen=True)
class Wiring:
    """Layers a family adds around the shared blocks, beyond what ``TransformerConfig`` fields say.

    embedding_norm: a norm after the summed embeddings (BERT's embedding LayerNorm).
    head_transform: a dense ``[h, h]`` layer + GELU before the head's norm (BERT's MLM transform).
    head_bias: an output bias ``[V]`` added to the logits (BERT's MLM decoder bias).
    """

    embedding_norm: bool = False
    head_transform: bool = False
    head_bias: bool = False


class ModelFamily(Protocol):
    """Everything plait knows about one architecture.

    Attributes:
        name: the arch key (``TransformerConfig.arch``), e.g. ``"llama"``.
        wiring: the :class:`Wiring` the shared layers build.
        hf: the Hugging Face model classes and name prefix (:class:`~plait.models.hf_base.HFClasses`).
        presets: preset name -> zero-argument ``TransformerConfig`` factory.
    """

    name: str
    wiring: Wiring
    hf: "HFClasses"
    presets: Mapping[str, Callable[[], "TransformerConfig"]]

    def make_config(self, **overrides) -> "TransformerConfig":
        """The family's default config (its reference size) with ``overrides``."""

    def hf_rules(self, config: "TransformerConfig", layout: "HFLayout") -> list["Rule"]:
        """Every plait <-> HF name rule of ``config`` in ``layout``."""

    def hf_ignored(self, name: str, config: "TransformerConfig") -> bool:
        """True for HF tensors that carry nothing to convert (buffers, copies of tied weights)."""

    def detect_layout(self, hf_names: set[str]) -> "HFLayout":
        """The layout an HF checkpoint with these tensor names was saved in."""

    def export_layout(self, config: "TransformerConfig", plait_names: set[str]) -> "HFLayout":
        """The HF layout an export of a checkpoint holding ``plait_names`` writes."""

    def config_from_hf(self, hf_config: Any) -> "TransformerConfig":
        """A ``TransformerConfig`` from the HF ``PretrainedConfig`` (ValueError for unsupported features)."""

    def config_to_hf(self, config: "TransformerConfig", extra: dict) -> Any:
        """The HF ``PretrainedConfig`` of ``config`` with ``extra`` fields (ValueError if inexpressible)."""
