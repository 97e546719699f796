"""Hugging Face name rules shared by every model family: :class:`Rule`, :class:`HFLayout` and the
tensor transforms of :data:`TRANSFORMS`.

A :class:`Rule` pairs one or more plait logical tensors with one or more Hugging Face tensors and
names the transform between them (``kind``, a key of :data:`TRANSFORMS`): ``copy``; ``transpose``
for GPT-2's ``Conv1D`` weights, stored ``[in, out]``; ``qkv_conv1d`` / ``qkv_bias`` for GPT-2's
fused ``c_attn``, stored ``[h, 3h]`` with q, k, v side by side along the output dim.

Imports only torch: the family modules (``plait.models.gpt2`` etc.) and ``plait.checkpoint.hf``
both build on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """``plait`` tensors <-> ``hf`` tensors through transform ``kind``.

    ``aliases``: other HF name tuples that hold the same values in some checkpoints (e.g. BERT's
    ``cls.predictions.decoder.bias`` for ``cls.predictions.bias``); an import reads the first
    alias present when ``hf`` is absent, and treats an unused alias as a duplicate to ignore.
    """

    plait: tuple[str, ...]
    hf: tuple[str, ...]
    kind: str = "copy"
    aliases: tuple[tuple[str, ...], ...] = ()


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


Transform = Callable[[Tensors], list]

#: Rule kind -> (HF tensors -> plait tensors, plait tensors -> HF tensors); the two are inverses.
TRANSFORMS: dict[str, tuple[Transform, Transform]] = {
    "copy": (_copy, _copy),
    "transpose": (_transpose, _transpose),
    "qkv_conv1d": (_split_qkv_conv1d, _fuse_qkv_conv1d),
    "qkv_bias": (_split_qkv_bias, _fuse_qkv_bias),
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
    return HFLayout(classes.model_type, classes.head_class if has_head else classes.base_class, prefix, True)


def decoder_export_layout(classes: HFClasses, config, plait_names: set[str]) -> HFLayout:
    """Layout a decoder export writes: the head class with the prefix; ``lm_head`` stored unless tied."""
    return HFLayout(classes.model_type, classes.head_class, classes.prefix, not config.tie_embeddings)


def unsupported(model_type: str, what: str) -> ValueError:
    """The error for an HF config feature plait does not implement."""
    return ValueError(f"Hugging Face {model_type} config: {what} is not supported by plait")


def require_fields(config, **want) -> None:
    """ValueError naming the fields of ``config`` that differ from ``want`` (what HF can express)."""
    bad = {k: getattr(config, k) for k, v in want.items() if getattr(config, k) != v}
    if bad:
        raise ValueError(f"plait {config.arch} config cannot be written as a Hugging Face {config.arch} model: "
                         f"it has {bad}, Hugging Face needs {({k: want[k] for k in bad})}")
