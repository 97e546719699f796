"""``TransformerConfig``: the architecture of a decoder or encoder, and the GPT-2 / Llama / BERT presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ARCHES = ("gpt2", "llama", "bert")


@dataclass
class TransformerConfig:
    """Architecture hyper-parameters (sizes in elements; no parallel layout here).

    ``arch`` picks the family's wiring: "gpt2" (learned positions, pre-norm LayerNorm, GELU-tanh,
    biases, tied head), "llama" (RoPE, pre-norm RMSNorm, SwiGLU, no biases, GQA, tied or untied
    head) or "bert" (learned + token-type positions, embedding LayerNorm, post-norm blocks, GELU,
    bidirectional attention, MLM head tied to the embedding). Use ``gpt2_config``,
    ``llama_config`` and ``bert_config`` for the family defaults.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    max_position_embeddings: int = 1024
    activation: str = "gelu_tanh"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    rope_theta: float | None = None
    bias: bool = True
    tie_embeddings: bool = True
    causal: bool = True
    post_norm: bool = False
    type_vocab_size: int = 0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    vocab_alignment: int = 128
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.arch not in ARCHES:
            raise ValueError(f"unknown arch {self.arch!r}; use one of {ARCHES}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) is not divisible by num_kv_heads ({self.num_kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_parameters(self) -> int:
        """Logical parameter count (no vocabulary padding; tied weights counted once)."""
        import math

        from plait.layers.model import TransformerModel  # local: counting on the meta device
        from plait.parallel.sharding import shard_of
        model = TransformerModel(self, device="meta")
        return sum(math.prod(shard_of(p).logical_shape) for p in model.parameters())

    def replace(self, **changes) -> "TransformerConfig":
        """A copy with ``changes``; fields still at their derived default (``num_kv_heads ==
        num_heads``, ``ffn_hidden_size == 4 * hidden_size``) follow the changed sizes."""
        if "num_kv_heads" not in changes and self.num_kv_heads == self.num_heads:
            changes["num_kv_heads"] = None
        if "ffn_hidden_size" not in changes and self.ffn_hidden_size == 4 * self.hidden_size:
            changes["ffn_hidden_size"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def gpt2_config(**overrides) -> TransformerConfig:
    """GPT-2 (Radford et al., 2019); defaults are GPT-2 small (124M)."""
    base = dict(arch="gpt2", vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                max_position_embeddings=1024, activation="gelu_tanh", norm="layernorm", bias=True,
                tie_embeddings=True)
    return TransformerConfig(**{**base, **overrides})


def llama_config(**overrides) -> TransformerConfig:
    """Llama (Touvron et al., 2023); defaults are ANCHORS.md's llama-886m benchmark model."""
    base = dict(arch="llama", vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16,
                num_kv_heads=8, ffn_hidden_size=5632, max_position_embeddings=2048, activation="swiglu",
                norm="rmsnorm", norm_eps=1e-5, rope_theta=10000.0, bias=False, tie_embeddings=False)
    return TransformerConfig(**{**base, **overrides})


def bert_config(**overrides) -> TransformerConfig:
    """BERT (Devlin et al., 2019); defaults are BERT-base with its MLM head."""
    base = dict(arch="bert", vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12,
                max_position_embeddings=512, activation="gelu", norm="layernorm", norm_eps=1e-12,
                bias=True, tie_embeddings=True, causal=False, post_norm=True, type_vocab_size=2,
                hidden_dropout=0.1, attention_dropout=0.1)
    return TransformerConfig(**{**base, **overrides})


PRESETS = {
    "gpt2-124m": lambda: gpt2_config(),
    "gpt2-tiny": lambda: gpt2_config(vocab_size=8192, hidden_size=128, num_layers=4, num_heads=4,
                                     max_position_embeddings=256),
    "llama-886m": lambda: llama_config(),
    "llama-5.9b": lambda: llama_config(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                       ffn_hidden_size=11008),
    "llama-tiny": lambda: llama_config(vocab_size=8192, hidden_size=128, num_layers=4, num_heads=4,
                                       num_kv_heads=2, ffn_hidden_size=352, max_position_embeddings=256),
    "bert-base": lambda: bert_config(),
    "bert-tiny": lambda: bert_config(vocab_size=8192, hidden_size=128, num_layers=4, num_heads=4,
                                     max_position_embeddings=256),
}


def preset(name: str, **overrides) -> TransformerConfig:
    """A named preset with optional overrides; ValueError listing the names for an unknown one."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]().replace(**overrides) if overrides else PRESETS[name]()
