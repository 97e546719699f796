"""Parallel-aware layers and the model builder shared by every family (``plait.models``)."""
from plait.layers.attention import Attention
from plait.layers.block import TransformerBlock
from plait.layers.config import TransformerConfig
from plait.layers.cross_entropy import vocab_parallel_cross_entropy
from plait.layers.embedding import VocabParallelEmbedding, padded_vocab_size
from plait.layers.fused_cross_entropy import fused_linear_cross_entropy
from plait.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from plait.layers.mlp import MLP
from plait.layers.model import EmbeddingLayer, LMHead, TransformerModel, logical_shapes
from plait.layers.moe import MoE
from plait.layers.norm import LayerNorm, RMSNorm

__all__ = [
    "Attention", "TransformerBlock", "TransformerConfig", "bert_config", "gpt2_config", "llama_config",
    "preset", "vocab_parallel_cross_entropy", "fused_linear_cross_entropy", "VocabParallelEmbedding",
    "padded_vocab_size", "ColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear", "MLP", "EmbeddingLayer",
    "LMHead", "TransformerModel", "LayerNorm", "RMSNorm", "logical_shapes", "MoE",
]

#: Re-exported from ``plait.models`` on first access (``plait.models`` imports ``plait.layers.config``).
_FROM_MODELS = ("preset", "gpt2_config", "llama_config", "bert_config")


def __getattr__(name: str):
    """``preset`` and the family defaults (``gpt2_config``, ...), from ``plait.models``."""
    if name in _FROM_MODELS:
        import plait.models

        return getattr(plait.models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
