"""Cross entropy over vocabulary-sharded logits.

Each tp rank holds logits for its block of the (padded) vocabulary, ``[..., V_pad/tp]``.
The loss needs only three reductions over tp, so full-vocabulary logits never exist on
one rank (Shoeybi et al., "Megatron-LM", 2019, Sec. 3): the max logit (all-reduce MAX),
then ``sum exp`` and the target logit (one all-reduce SUM of a stacked tensor).

With label smoothing ``eps`` over the V real classes (Szegedy et al., 2016, Sec. 7):
``loss = (1 - eps) * (lse - z_t) + eps * (lse - mean_j z_j)``, ``lse = log sum_j exp z_j``.
The gradient w.r.t. the logits is ``softmax - (1 - eps) * onehot(t) - eps / V`` on real
classes and zero on padded ones. Tokens whose label equals ``ignore_index`` get loss 0
and zero gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.distributed as dist

from plait.parallel.collectives import group_size


def block_statistics(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    vocab_start: int,
    group,
    ignore_index: int,
    smoothing: float,
):
    """Per-token loss and softmax of rows of this rank's vocabulary block (the tp reductions above).

    Shared by ``vocab_parallel_cross_entropy`` (all rows at once) and
    ``plait.layers.fused_cross_entropy`` (one token chunk at a time): every tp rank must call it with
    the same rows, since it runs two all-reduces over ``group``.

    Args:
        logits: ``[T, W]`` (or ``[..., W]``) this rank's columns, any float dtype (upcast to float32).
        target: ``[T]`` (or ``[...]``) int64 global ids or ``ignore_index``.

    Returns:
        ``(loss, softmax, state, ignored)``: ``loss [T]`` float32 (0 where ignored); ``softmax [T, W]``
        float32 over the real vocabulary (0 on padded columns; a fresh tensor the caller may edit in
        place); ``state = (idx, in_block, valid)`` for :func:`logits_gradient_`; ``ignored [T]`` bool.
    """
    z = logits.float()
    width = z.shape[-1]
    cols = torch.arange(vocab_start, vocab_start + width, device=z.device)
    valid = cols < vocab_size  # padded columns excluded
    z = z.masked_fill(~valid, float("-inf"))
    zmax = z.max(dim=-1).values
    if group_size(group) > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    z = z - zmax.unsqueeze(-1)
    exp = z.exp()
    local_t = target - vocab_start
    in_block = (local_t >= 0) & (local_t < width)
    idx = local_t.clamp(0, width - 1).unsqueeze(-1)
    z_target = torch.gather(z, -1, idx).squeeze(-1).masked_fill(~in_block, 0.0)
    sums = [exp.sum(-1), z_target]
    if smoothing > 0:
        sums.append(z.masked_fill(~valid, 0.0).sum(-1))
    stacked = torch.stack(sums)
    if group_size(group) > 1:
        dist.all_reduce(stacked, group=group)
    lse = stacked[0].log()
    loss = lse - stacked[1]
    if smoothing > 0:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - stacked[2] / vocab_size)
    ignored = target == ignore_index
    loss = loss.masked_fill(ignored, 0.0)
    exp.div_(stacked[0].unsqueeze(-1))  # softmax, in place
    return loss, exp, (idx, in_block, valid), ignored


def logits_gradient_(
    softmax: torch.Tensor,
    idx: torch.Tensor,
    in_block: torch.Tensor,
    valid: torch.Tensor,
    smoothing: float,
    vocab_size: int,
) -> torch.Tensor:
    """In place: ``softmax [T, W]`` float32 -> ``d loss_t / d logits`` of each token's own loss
    (``softmax - (1 - eps) * onehot(t) - eps / V`` on real columns, 0 on padded ones); not yet
    zeroed for ignored tokens nor scaled by the loss gradient. Returns ``softmax``."""
    onehot_weight = (1.0 - smoothing) * in_block.to(softmax.dtype)
    softmax.scatter_add_(-1, idx, -onehot_weight.unsqueeze(-1))
    if smoothing > 0:
        softmax.sub_(valid.to(softmax.dtype) * (smoothing / vocab_size))
    return softmax


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, vocab_start, group, ignore_index, smoothing):
        loss, softmax, state, ignored = block_statistics(
            logits, target, vocab_size, vocab_start, group, ignore_index, smoothing
        )
        ctx.save_for_backward(softmax, *state, ignored)
        ctx.smoothing, ctx.vocab_size, ctx.dtype = smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, in_block, valid, ignored = ctx.saved_tensors
        grad = logits_gradient_(softmax, idx, in_block, valid, ctx.smoothing, ctx.vocab_size)
        scale = grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1)
        return (grad * scale).to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    vocab_start: int = 0,
    group=None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross entropy from this rank's vocabulary block of the logits.

    Args:
        logits: ``[..., V_pad/tp]`` this rank's columns (global ids ``vocab_start`` onwards).
        target: ``[...]`` int64 global token ids (or ``ignore_index``).
        vocab_size: the real vocabulary size V; columns at or beyond it are padding.
        vocab_start: global id of this rank's first column.
        group: tp group (None: logits hold the whole vocabulary).
        label_smoothing: eps in [0, 1).

    Returns: ``[...]`` float32 loss per token, identical on every tp rank (0 where ignored).
    With the whole vocabulary on one rank (``group`` of one) this is torch's ``F.cross_entropy`` on the
    float32 logits of the real columns: the same formula, in its fused log-softmax kernels.

    Raises:
        ValueError: label_smoothing outside [0, 1) or mismatched shapes.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree "
            "on the leading dims"
        )
    if group_size(group) == 1 and vocab_start == 0:
        real = logits[..., :vocab_size].float()
        return F.cross_entropy(
            real.reshape(-1, vocab_size),
            target.reshape(-1),
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction="none",
        ).view(target.shape)
    return _VocabParallelCrossEntropy.apply(
        logits, target, vocab_size, vocab_start, group, ignore_index, float(label_smoothing)
    )
