"""Token-wise layers run over tiles of the sequence, keeping only their input for backward.

Arctic Long Sequence Training (Bekman et al., "Arctic Long Sequence Training: Scalable and Efficient
Training for Multi-Million Token Sequences", 2025, Sec. 3.2, TiledMLP): a layer that treats every token
alone (an MLP) gives the same result on any split of the sequence, so for a long sequence it can run tile
by tile and keep none of its inner activations (``[b, s, ffn/tp]`` each) from forward to backward:
backward recomputes each tile's forward and takes its gradients right away. At most one tile's inner
activations exist at a time; the cost is one more forward of the layer, as with activation
checkpointing of that layer alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class _SequenceTiles(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tokens: int, x, *params):
        ctx.fn, ctx.tokens, ctx.params = (
            fn,
            tokens,
            params,
        )  # parameters: leaves, held by the module anyway
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(tile) for tile in x.split(tokens, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        params = ctx.params
        dx = torch.empty_like(x)
        dparams = [None] * len(params)
        for tile, out, dtile in zip(
            x.split(ctx.tokens, dim=1), grad.split(ctx.tokens, dim=1), dx.split(ctx.tokens, dim=1)
        ):
            with torch.enable_grad():
                leaf = tile.detach().requires_grad_(True)
                grads = torch.autograd.grad(ctx.fn(leaf), (leaf, *params), out, allow_unused=True)
            dtile.copy_(grads[0])
            for i, g in enumerate(grads[1:]):
                if g is not None:  # summed in float32 over the tiles, rounded once
                    dparams[i] = g.float() if dparams[i] is None else dparams[i].add_(g)
        return (
            None,
            None,
            dx,
            *(None if g is None else g.to(p.dtype) for g, p in zip(dparams, params)),
        )


def sequence_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tokens: int, module: nn.Module
) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn`` (``[b, s, ...] -> [b, s, ...]``), computed over tiles of ``tokens``
    positions along dim 1 and recomputed per tile in backward (module docstring). ``module``: the owner of
    the parameters ``fn`` uses (their gradients are returned through this function, accumulated once).
    Without gradients (evaluation) the tiles run one after the other as well. Under sequence parallelism
    ``x`` is this tp rank's part of the sequence, so each tile is ``tokens x tp`` positions once gathered."""
    if tokens <= 0 or x.shape[1] <= tokens:
        return fn(x)
    if not torch.is_grad_enabled():
        return torch.cat([fn(tile) for tile in x.split(tokens, dim=1)], dim=1)
    return _SequenceTiles.apply(fn, tokens, x, *[p for p in module.parameters() if p.requires_grad])
