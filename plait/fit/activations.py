"""Activation and loss bytes of a Llama-style decoder in training, per micro-batch token.

Source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023,
Sec. 4.1: a GPT block saves ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit training. Redone here for the Hugging
Face Llama block (``LlamaDecoderLayer``) in bf16, with flash/SDPA attention (no ``a*s^2`` scores are kept: the
kernel saves its inputs, output and a float32 log-sum-exp per head), no dropout, RMSNorm, SwiGLU and grouped
query attention (``kv`` key/value heads of width ``d``); per token, in bytes:

    each RMSNorm (x2):   its float32 input 4h (read by the backward of x * rsqrt) + its bf16 output 2h
    attention:           q, k, v after RoPE 2h + 2*kv*d + 2*kv*d, the kernel's output 2h, the output made
                         contiguous for o_proj 2h, the log-sum-exp 4*a
    SwiGLU MLP:          gate 2f, silu(gate) 2f, up 2f, silu(gate) * up 2f

    block = 18h + 4*kv*d + 8f + 4a                     (Korthikanti's 34h for GPT-3 with dropout)

With activation checkpointing of every block (the Trainer's ``gradient_checkpointing``, plait's
``activation_checkpointing``) a block keeps only its input, 2h, and one block's activations are rebuilt at a
time in backward.

The loss (``LlamaForCausalLM`` with its cross entropy on float32 logits): bf16 logits 2V, their float32 copy
4V and the saved log-probabilities 4V in forward; in backward the log-probabilities, their gradient and the
logits' gradient, 4V each: at most :data:`LOSS_BYTES_PER_VOCAB` = 12 bytes per vocabulary entry and token.
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
