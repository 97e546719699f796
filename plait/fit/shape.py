"""The shape of a dense Llama-style decoder, read from a Hugging Face ``config.json`` or a plait preset, with
its parameter counts; nothing is built.

A block of such a model (Llama, Mistral, Qwen2/3 without experts) holds the q/k/v/o projections
(``num_heads`` query and ``num_kv_heads`` key/value heads of ``head_dim``), a SwiGLU MLP (gate, up and down
projections of width ``ffn_hidden_size``) and two RMSNorm weights; the model adds the embedding, a final norm
and an output head (tied to the embedding or not).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from plait.models.hf_sizes import check_hf_sizes
from plait.untrusted import inside, read_json

#: Hugging Face model types whose blocks are dense Llama-style (RMSNorm, SwiGLU, GQA, RoPE).
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
#: The most parameters a shape may have (10**15): sizes beyond it are a wrong config, not a model.
MAX_PARAMS = 10**15


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a dense Llama-style decoder (elements; ``name`` says where they came from)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    tied_embeddings: bool = False

    @property
    def block_params(self) -> int:
        """Parameters of one block: q, o ``[h, heads*d]``, k, v ``[h, kv*d]``, gate/up/down ``[h, ffn]``, two norms."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return 2 * h * q + 2 * h * kv + 3 * h * self.ffn_hidden_size + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The final norm and the output head (0 elements for a tied head)."""
        return self.hidden_size + (
            0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        )

    @property
    def params(self) -> int:
        """All parameters (a tied head counted once)."""
        return self.embedding_params + self.num_layers * self.block_params + self.head_params

    def with_layers(self, num_layers: int) -> "ModelShape":
        """The same widths with ``num_layers`` blocks (the shape family :func:`plait.fit.largest_fitting` walks)."""
        return replace(self, num_layers=num_layers, name=f"{self.name} with {num_layers} layers")


def shape_from_hf(config: Mapping, where: str = "config.json") -> ModelShape:
    """The shape in a Hugging Face ``config.json`` dict (read from ``where``).

    Raises:
        ValueError: a size that is not a whole number in range (``plait.models.hf_sizes``), a model type that is
            not a dense Llama-style decoder (names it and :data:`LLAMA_LIKE`), heads that do not divide the
            hidden size without a ``head_dim``, or more than :data:`MAX_PARAMS` parameters (names the sizes).
    """
    if not isinstance(config, Mapping):
        raise ValueError(
            f"{where} must hold a JSON object (the model's config), got {type(config).__name__}"
        )
    check_hf_sizes(config, where)
    kind = config.get("model_type")
    if kind not in LLAMA_LIKE or config.get("num_local_experts") or config.get("num_experts"):
        raise ValueError(
            f"{where} model_type={kind!r}: plait estimate-memory covers dense Llama-style decoders "
            f"(model_type one of {', '.join(LLAMA_LIKE)}, no experts); pass such a config.json"
        )
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
    ):
        if config.get(key) is None:
            raise ValueError(f"{where} has no {key}; it is needed to size the model (fix the file)")
    h, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is None:
        if h % heads:
            raise ValueError(
                f"{where} hidden_size={h} is not a multiple of num_attention_heads={heads} and no "
                "head_dim is given; fix these keys"
            )
        head_dim = h // heads
    shape = ModelShape(
        name=where,
        vocab_size=config["vocab_size"],
        hidden_size=h,
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        ffn_hidden_size=config["intermediate_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    return check_shape(shape, where)


def check_shape(shape: ModelShape, where: str) -> ModelShape:
    """``shape`` when its parameter count is at most :data:`MAX_PARAMS` (ValueError naming the sizes)."""
    if shape.params > MAX_PARAMS:
        raise ValueError(
            f"{where} hidden_size={shape.hidden_size}, num_hidden_layers={shape.num_layers}, "
            f"intermediate_size={shape.ffn_hidden_size}, vocab_size={shape.vocab_size} give "
            f"{shape.params:.3e} parameters, more than {MAX_PARAMS:.0e}: not a model any machine "
            "trains; fix these sizes"
        )
    return shape


def read_hf_shape(path: str) -> ModelShape:
    """The shape in the ``config.json`` at ``path`` (the file, or a folder holding it), read as a file from
    elsewhere: confined to its folder, regular, at most ``plait.untrusted.SMALL_FILE_CAP`` bytes.

    Raises:
        FileNotFoundError: no such file or folder. ValueError: not JSON, or as :func:`shape_from_hf`.
    """
    if os.path.isdir(path):
        path = inside(path, "config.json", "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no config.json at {path}: pass a Hugging Face config.json, the folder holding "
            "it, or a preset name"
        )
    return shape_from_hf(read_json(path, "config.json"), path)


def preset_shape(name: str) -> ModelShape:
    """The shape of plait's preset ``name`` (``plait.models.registry``; Llama presets only).

    Raises:
        ValueError: an unknown preset (lists them) or one that is not a dense Llama (names its arch).
    """
    from plait.models.registry import preset  # local: the registry imports every family

    c = preset(name)
    if c.arch != "llama" or c.num_experts:
        raise ValueError(
            f"preset {name!r} is a {c.arch} model{' with experts' if c.num_experts else ''}; "
            "plait estimate-memory covers dense Llama-style presets"
        )
    return ModelShape(
        name=f"preset {name}",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_layers=c.num_layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim or c.hidden_size // c.num_heads,
        ffn_hidden_size=c.ffn_hidden_size,
        tied_embeddings=c.tie_embeddings,
    )
