"""Parallel-aware layers and the GPT-2 / Llama / BERT model builders."""
from plait.layers.attention import Attention
from plait.layers.block import TransformerBlock
from plait.layers.config import TransformerConfig, bert_config, gpt2_config, llama_config, preset
from plait.layers.cross_entropy import vocab_parallel_cross_entropy
from plait.layers.embedding import VocabParallelEmbedding, padded_vocab_size
from plait.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from plait.layers.mlp import MLP
from plait.layers.model import EmbeddingLayer, LMHead, TransformerModel
from plait.layers.norm import LayerNorm, RMSNorm

__all__ = [
    "Attention", "TransformerBlock", "TransformerConfig", "bert_config", "gpt2_config", "llama_config",
    "preset", "vocab_parallel_cross_entropy", "VocabParallelEmbedding", "padded_vocab_size",
    "ColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear", "MLP", "EmbeddingLayer", "LMHead",
    "TransformerModel", "LayerNorm", "RMSNorm",
]
