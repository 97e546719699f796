"""What a model family (GPT-2, Llama, BERT, ...) provides: the :class:`ModelFamily` record.

A family is one module of ``plait.models`` holding everything about one architecture: its
presets (whose ``TransformerConfig`` carries every field the shared layers build from), its Hugging
Face name rules and its HF config mapping. The registry
(``plait.models.registry``) finds it by its arch name (``TransformerConfig.arch``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from plait.models.hf_base import decoder_export_layout, decoder_layout

if TYPE_CHECKING:
    from plait.layers.config import TransformerConfig
    from plait.models.hf_base import HFClasses, HFLayout, Rule


@dataclass(frozen=True)
class ModelFamily:
    """Everything plait knows about one architecture (one instance per family module).

    Attributes:
        name: the arch key (``TransformerConfig.arch``), e.g. ``"llama"``.
        hf: the Hugging Face model classes and name prefix (:class:`~plait.models.hf_base.HFClasses`).
        presets: preset name -> zero-argument ``TransformerConfig`` factory.
        make_config: ``(**overrides) -> TransformerConfig``, the family's reference size with overrides.
        hf_rules: ``(config, layout) -> [Rule]``, every plait <-> HF name rule of ``config`` in ``layout``.
        config_from_hf: HF ``PretrainedConfig`` -> ``TransformerConfig`` (ValueError for unsupported features).
        config_to_hf: ``(config, extra) ->`` HF ``PretrainedConfig`` (ValueError if inexpressible).
        buffers: HF tensor names that are buffers, not weights (nothing to convert).
        tied_head: the HF name of the output weight, a copy of the embedding when ``tie_embeddings``.
        layout_of: ``(hf, hf_names) -> HFLayout``, the layout an HF checkpoint was saved in.
        export_layout_of: ``(hf, config, plait_names) -> HFLayout``, the layout an export writes.
    """

    name: str
    hf: "HFClasses"
    presets: Mapping[str, Callable[[], "TransformerConfig"]]
    make_config: Callable[..., "TransformerConfig"]
    hf_rules: Callable[["TransformerConfig", "HFLayout"], list["Rule"]]
    config_from_hf: Callable[[Any], "TransformerConfig"]
    config_to_hf: Callable[["TransformerConfig", dict], Any]
    buffers: re.Pattern
    tied_head: str = "lm_head.weight"
    layout_of: Callable[["HFClasses", set[str]], "HFLayout"] = decoder_layout
    export_layout_of: Callable[["HFClasses", "TransformerConfig", set[str]], "HFLayout"] = (
        decoder_export_layout
    )

    def hf_ignored(self, name: str, config: "TransformerConfig") -> bool:
        """True for HF tensors that carry nothing to convert (buffers, the copy of a tied weight)."""
        return bool(self.buffers.search(name)) or (config.tie_embeddings and name == self.tied_head)

    def detect_layout(self, hf_names: set[str]) -> "HFLayout":
        """The layout an HF checkpoint with these tensor names was saved in."""
        return self.layout_of(self.hf, hf_names)

    def export_layout(self, config: "TransformerConfig", plait_names: set[str]) -> "HFLayout":
        """The HF layout an export of a checkpoint holding ``plait_names`` writes."""
        return self.export_layout_of(self.hf, config, plait_names)
