"""The LM head's matmul fused with the vocabulary-parallel cross entropy, chunked over tokens.

``fused_linear_cross_entropy(hidden, weight, bias, target, ...)`` computes, per chunk of ``chunk_tokens``
rows, the local logits, the vocabulary-parallel loss (Shoeybi et al., "Megatron-LM", 2019, Sec. 3) and at
once the input, weight and bias gradients (float32 sums), then drops the logits: at most one chunk's
``[chunk_tokens, V_pad/tp]`` float32 tensors exist at a time (Liger-Kernel's technique, Hsu et al. 2024,
in plain torch for sharded vocabularies). Backward scales the stored gradients by the loss gradient when
it is equal over non-ignored tokens (a sum or mean), else recomputes the chunks with per-token weights.

Under tp, ``hidden`` is the head's input after ``enter_tp_region``, whose backward sums the partial
input gradients. Design: ``docs/layers.md``; memory and time against the unfused head:
``benchmarks/results/fused_cross_entropy_1xH100.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.layers.cross_entropy import block_statistics, logits_gradient_

#: Default token chunk: 1024 rows of ``V_pad/tp`` float32 logits (e.g. 128 MiB at V/tp = 32k).
DEFAULT_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class _Options:
    vocab_size: int
    vocab_start: int
    group: object
    ignore_index: int
    smoothing: float
    chunk: int
    summed: bool = False  # the Function returns the sum of the per-token losses (a scalar)


def _zeros32(like: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device) if needed else None


def _chunked_pass(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    o: _Options,
    need: tuple[bool, bool, bool],
    token_weight: torch.Tensor | None = None,
):
    """One pass over the token chunks of ``x [N, h]`` (target ``[N]``).

    Returns ``(loss, grad_x, grad_weight, grad_bias)``: the per-token loss ``[N]`` float32 and, for
    the inputs flagged in ``need`` (x, weight, bias; else None), the gradients of
    ``sum_t w_t * loss_t``, ``w_t = token_weight[t]`` (1 when None), 0 for ignored tokens: the input
    gradient in ``x``'s dtype, the weight and bias gradients summed over chunks in float32 (the caller
    scales them there and casts after, so a sum over many tokens cannot overflow fp16 before the mean's
    factor applies).
    Runs two all-reduces over ``o.group`` per chunk: every tp rank must make the same call.
    """
    n = x.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if need[0] else None
    grad_w, grad_b = _zeros32(weight, need[1]), _zeros32(bias, need[2])
    for start in range(0, n, o.chunk):
        rows = slice(start, min(start + o.chunk, n))
        xc = x[rows]
        logits = F.linear(xc, weight, bias)  # [c, V_pad/tp], x.dtype
        loss[rows], softmax, state, ignored = block_statistics(
            logits, target[rows], o.vocab_size, o.vocab_start, o.group, o.ignore_index, o.smoothing
        )
        del logits
        if not any(need):
            continue
        grad = logits_gradient_(softmax, *state, o.smoothing, o.vocab_size)  # float32
        scale = (
            (~ignored).float()
            if token_weight is None
            else token_weight[rows].masked_fill(ignored, 0.0)
        )
        grad.mul_(scale.unsqueeze(-1))
        if grad_b is not None:
            grad_b.add_(grad.sum(0))
        grad = grad.to(x.dtype)
        if grad_x is not None:
            grad_x[rows] = grad @ weight
        if grad_w is not None:
            grad_w.add_(grad.t() @ xc)
    return loss, grad_x, grad_w, grad_b


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, opts):
        wants = ctx.needs_input_grad
        need = (wants[0], wants[1], bias is not None and wants[2])
        loss, grad_x, grad_w, grad_b = _chunked_pass(x, weight, bias, target, opts, need)
        ctx.opts, ctx.need, ctx.dtypes = (
            opts,
            need,
            (weight.dtype, None if bias is None else bias.dtype),
        )
        # x, weight and bias only for a token-weighted per-token loss (backward's recomputation);
        # no [N, V] tensor either way.
        kept = (x, weight, bias) if not opts.summed else (None, None, None)
        ctx.save_for_backward(grad_x, grad_w, grad_b, target, *kept)
        return loss.sum() if opts.summed else loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, grad_b, target, x, weight, bias = ctx.saved_tensors
        g = grad_loss.float()
        if ctx.opts.summed:  # one factor for every token: no check, no host sync
            return _scaled(grad_x, g, grad_w, grad_b, g, ctx.dtypes)
        kept = g[target != ctx.opts.ignore_index]
        if kept.numel() and not bool((kept == kept[0]).all()):
            # Tokens weighted unequally: the forward's gradients (weight 1 per token) do not apply.
            _, grad_x, grad_w, grad_b = _chunked_pass(
                x, weight, bias, target, ctx.opts, ctx.need, g
            )
            return _scaled(grad_x, None, grad_w, grad_b, None, ctx.dtypes)
        factor = kept[0] if kept.numel() else g.new_ones(())
        return _scaled(grad_x, g.unsqueeze(-1), grad_w, grad_b, factor, ctx.dtypes)


def _scaled(grad_x, x_factor, grad_w, grad_b, factor, dtypes):
    """The gradients for autograd: ``grad_x * x_factor`` (float32 math, ``x``'s dtype) and the float32
    weight and bias sums times ``factor``, cast to the parameters' dtypes after scaling. Out of place:
    the zero-bubble split may run the node twice on the same saved gradients."""
    if grad_x is not None and x_factor is not None:
        grad_x = (grad_x * x_factor).to(grad_x.dtype)
    if grad_w is not None:
        grad_w = (grad_w if factor is None else grad_w * factor).to(dtypes[0])
    if grad_b is not None:
        grad_b = (grad_b if factor is None else grad_b * factor).to(dtypes[1])
    return grad_x, grad_w, grad_b, None, None


def _check(hidden, weight, bias, target, label_smoothing, chunk_tokens, reduction) -> None:
    if reduction not in ("none", "sum"):
        raise ValueError(f"reduction must be 'none' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} disagree on the "
            "leading dims; pass hidden [..., h] with target [...]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be [V_pad/tp, h] with h = {hidden.shape[-1]} "
            f"(hidden {tuple(hidden.shape)})"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"bias {tuple(bias.shape)} must be [{weight.shape[0]}], one per weight row"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(
            f"chunk_tokens must be a positive int (tokens per chunk), got {chunk_tokens!r}; "
            f"e.g. {DEFAULT_CHUNK_TOKENS}"
        )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    vocab_size: int,
    vocab_start: int = 0,
    group=None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    reduction: str = "none",
) -> torch.Tensor:
    """Per-token cross entropy of ``F.linear(hidden, weight, bias)`` without materializing those logits.

    Equals ``vocab_parallel_cross_entropy(F.linear(hidden, weight, bias), target, ...)`` in value and
    gradients (w.r.t. ``hidden``, ``weight``, ``bias``) up to float rounding, holding at most one chunk
    of ``[chunk_tokens, V_pad/tp]`` float32 logits at a time and none after forward (module docstring).

    Args:
        hidden: ``[..., h]`` the head's input after ``enter_tp_region`` (the same on every tp rank);
            any float dtype: the matmuls run in it, the softmax math in float32.
        weight: ``[V_pad/tp, h]`` this rank's rows of the output weight (global ids ``vocab_start``
            onwards), same dtype as ``hidden``. bias: ``[V_pad/tp]`` or None.
        target: ``[...]`` int64 global token ids (or ``ignore_index``).
        vocab_size: the real vocabulary size V; rows at or beyond it are padding.
        vocab_start: global id of this rank's first row. group: tp group (None: one process).
        label_smoothing: eps in [0, 1) (over the V real classes).
        chunk_tokens: tokens per chunk (a positive int; need not divide the token count). Each chunk
            runs two all-reduces over tp: larger chunks mean fewer collectives, more memory.
        reduction: "none": the loss per token; "sum": their sum, a scalar (backward then scales the
            gradients by one number without looking at them: no host sync on CUDA).

    Returns: ``[...]`` float32 loss per token (nats), identical on every tp rank (0 where ignored), or
    their sum ``[]`` with ``reduction="sum"``. Its gradient must be identical on every tp rank too (it
    is for any reduction of these losses); with "none", a gradient that differs between non-ignored
    tokens makes backward recompute the chunks, and checking it costs one host sync on CUDA.

    Raises:
        ValueError: label_smoothing outside [0, 1), hidden/target/weight/bias shapes that disagree,
            chunk_tokens not a positive int, or reduction not "none" / "sum".
    """
    _check(hidden, weight, bias, target, label_smoothing, chunk_tokens, reduction)
    opts = _Options(
        vocab_size,
        vocab_start,
        group,
        ignore_index,
        float(label_smoothing),
        chunk_tokens,
        reduction == "sum",
    )
    loss = _flat_loss(hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), opts)
    return loss if opts.summed else loss.reshape(target.shape)


def _flat_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    t: torch.Tensor,
    opts: _Options,
) -> torch.Tensor:
    """The loss of ``x [n, h]`` against ``t [n]``: through the autograd Function where a gradient is wanted,
    else one forward pass that keeps no gradient sums."""
    if torch.is_grad_enabled() and any(
        p is not None and p.requires_grad for p in (x, weight, bias)
    ):
        return _FusedLinearCrossEntropy.apply(x, weight, bias, t, opts)
    loss = _chunked_pass(x, weight, bias, t, opts, (False, False, False))[0]
    return loss.sum() if opts.summed else loss
