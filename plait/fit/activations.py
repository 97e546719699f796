"""Activation and loss bytes of a Llama-style decoder in training, per micro-batch token.

Source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023,
Sec. 4.1, redone for the Hugging Face Llama block in bf16 with flash/SDPA attention, no dropout, RMSNorm,
SwiGLU and grouped query attention (``kv`` key/value heads of width ``d``, ``a`` heads, hidden ``h``, MLP
width ``f``); per token, in bytes::

    block = 18h + 4*kv*d + 8f + 4a         (with every block checkpointed: its input, 2h)
    loss  <= LOSS_BYTES_PER_VOCAB * V = 12 V  (float32 cross entropy over the vocabulary V)

The term-by-term derivation: ``docs/fit.md``.
"""

from __future__ import annotations

from plait.fit.shape import ModelShape

#: Bytes per token and vocabulary entry at the loss's peak (module docstring): three float32 [tokens, V] tensors.
LOSS_BYTES_PER_VOCAB = 12


def block_bytes_per_token(shape: ModelShape) -> int:
    """Bytes one block saves for backward per token, without checkpointing: ``18h + 4*kv*d + 8f + 4a``."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return 18 * h + 4 * shape.num_kv_heads * shape.head_dim + 8 * f + 4 * shape.num_heads


def loss_bytes_per_token(shape: ModelShape) -> int:
    """Bytes per token of the logits and the cross entropy at their peak: ``12 * vocab_size``."""
    return LOSS_BYTES_PER_VOCAB * shape.vocab_size


def activation_peak(shape: ModelShape, tokens: int, checkpointing: bool) -> int:
    """Peak bytes of activations and loss of one micro-batch of ``tokens`` (micro-batch x sequence) tokens.

    Without checkpointing every block's activations are alive when the loss peaks. With it, the blocks'
    inputs stay alive and either the loss peaks (start of backward) or one block is rebuilt: the larger.
    """
    block, loss = block_bytes_per_token(shape), loss_bytes_per_token(shape)
    if not checkpointing:
        return tokens * (shape.num_layers * block + loss)
    return tokens * (shape.num_layers * 2 * shape.hidden_size + max(block, loss))
