"""Parallel-aware layers and the model builder shared by every family (``plait.models`` builds on these;
nothing here imports it)."""

from plait.layers.attention import Attention
from plait.layers.block import TransformerBlock
from plait.layers.config import TransformerConfig
from plait.layers.cross_entropy import vocab_parallel_cross_entropy
from plait.layers.embedding import VocabParallelEmbedding, padded_vocab_size
from plait.layers.fused_cross_entropy import fused_linear_cross_entropy
from plait.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from plait.layers.mlp import MLP
from plait.layers.ends import EmbeddingLayer, LMHead
from plait.layers.model import TransformerModel, logical_shapes
from plait.layers.moe import MoE
from plait.layers.norm import LayerNorm, RMSNorm

__all__ = [
    "Attention",
    "TransformerBlock",
    "TransformerConfig",
    "vocab_parallel_cross_entropy",
    "fused_linear_cross_entropy",
    "VocabParallelEmbedding",
    "padded_vocab_size",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ReplicatedLinear",
    "MLP",
    "EmbeddingLayer",
    "LMHead",
    "TransformerModel",
    "LayerNorm",
    "RMSNorm",
    "logical_shapes",
    "MoE",
]
