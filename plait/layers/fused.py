"""One matmul for several column-parallel projections of one input: fused QKV and SwiGLU gate/up.

On each tp rank, ``q_proj``, ``k_proj`` and ``v_proj`` hold their column-parallel row blocks
``[heads/tp * head_dim, h]`` (Shoeybi et al., "Megatron-LM", 2019, Sec. 3). Stacked by rows they
are this rank's slice of one fused projection ``[sum_i out_i/tp, h]``, and ``x W_f^T`` holds the
projections side by side: one GEMM instead of three in forward, and one each for the input and
the weight gradient in backward (Megatron-LM's ``linear_qkv`` / ``linear_fc1`` do the same with
one stored fused parameter). Here the parameters stay separate (names, ``TPShard`` marks and
checkpoints unchanged) and the fused weight is built on the fly:

* as a ``torch.cat`` copy in the caller's order, for every layout. A zero-copy view of weights that lie
  back to back in a ZeRO flat buffer would save the copy, but the GEMM's rounding then depends on
  where the layout put them (row order, pointer alignment), and two layouts of one model (device
  ZeRO-2 and ZeRO-Offload) train to different bits. Under ``torch.compile`` the layers run separate
  matmuls instead (``fused_column_forward``).

Backward saves only ``x`` and the separate parameters, never a fused copy, and rebuilds the fused
weight. The zero-bubble pipeline's weight pass (``plait.parallel.weight_grad.plan``) computes this
node's weight half on its own through :meth:`FusedColumnLinear.weight_side`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The copying path (a function of its own so tests can count the copies)."""
    return torch.cat(parts)


def fuse_rows(tensors: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    """``tensors[order[0]], tensors[order[1]], ...`` stacked along dim 0 (a ``torch.cat`` copy).
    Shapes: ``[r_i, *rest]`` each -> ``[sum r_i, *rest]``."""
    return _cat_rows([tensors[i] for i in order])


def _saved_tensor_hooks_active() -> bool:
    """True when saved-tensor hooks (activation checkpointing, offload) will pack what forward saves."""
    if torch.compiler.is_compiling():
        return True
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError, RuntimeError):   # private API: assume hooks when it is gone
        return True


def param_grads(dy: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor], order: Sequence[int],
                want: Sequence[bool]) -> list[torch.Tensor | None]:
    """Gradients of ``params`` (``n`` weights, then ``n`` or 0 biases) of ``y = x W_f^T + b_f``.

    One GEMM ``dW_f = dy^T x`` (``[sum out_i, in]``) whose row blocks are the weight gradients, and
    one sum over tokens for the biases; an entry is None where ``want`` is False.
    Shapes: ``dy [..., sum out_i]`` (columns in ``order``), ``x [..., in]``.
    """
    n = len(order)
    out: list[torch.Tensor | None] = [None] * len(params)
    sizes = [params[i].shape[0] for i in order]
    dy2 = dy.reshape(-1, dy.shape[-1])
    if any(want[:n]):
        dw = dy2.t().mm(x.reshape(-1, x.shape[-1]))
        for i, g in zip(order, dw.split(sizes)):
            out[i] = g if want[i] else None
    if any(want[n:]):
        db = dy2.sum(0)
        for i, g in zip(order, db.split(sizes)):
            out[n + i] = g if want[n + i] else None
    return out


class FusedColumnLinear(torch.autograd.Function):
    """``y = x W_f^T + b_f`` with ``W_f = fuse_rows(weights, order)``: one matmul for several projections.

    ``apply(x, order, *weights, *biases)``: ``x [..., in]``; ``order`` a permutation of the ``n``
    weights ``[out_i, in]`` (their memory order, or ``range(n)``); biases ``[out_i]``, all or none.
    Returns ``y [..., sum out_i]`` with the projections' columns in ``order``.
    """

    @staticmethod
    def forward(ctx, x, order, *params):
        n = len(order)
        ctx.order, ctx.deferred = tuple(order), frozenset()
        ctx.hooked = _saved_tensor_hooks_active()
        ctx.save_for_backward(x, *params)
        bias = fuse_rows(params[n:], order) if len(params) > n else None
        return F.linear(x, fuse_rows(params[:n], order), bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        dx = dy.matmul(fuse_rows(params[:len(ctx.order)], ctx.order)) if ctx.needs_input_grad[0] else None
        want = [ctx.needs_input_grad[2 + j] and j not in ctx.deferred for j in range(len(params))]
        return (dx, None, *param_grads(dy, x, params, ctx.order, want))

    @staticmethod
    def weight_side(node, side: list):
        """``(fn, eager)`` for the zero-bubble split (``plait.parallel.weight_grad.plan``).

        ``side``: ``[(i, child, k)]``, the node's parameter-side inputs ``i`` (``next_functions``
        index: 0 is ``x``, then the weights and biases). From now on the node's own backward (the
        input-gradient pass) skips them; ``fn(dy)`` returns their gradients, computed as the plain
        backward does. ``eager``: the saved tensors were read now (no saved-tensor hooks). None when
        ``x`` itself is on the parameter side (not a shape the split knows).
        """
        if any(i == 0 for i, _, _ in side):
            return None
        idx = [i - 1 for i, _, _ in side]
        eager = not node.hooked
        saved = node.saved_tensors if eager else None
        node.deferred = frozenset(idx)

        def fn(dy):
            x, *params = saved if saved is not None else node.saved_tensors
            grads = param_grads(dy, x, params, node.order, [j in node.deferred for j in range(len(params))])
            return [grads[j] for j in idx]
        return fn, eager


def fused_linear(x: torch.Tensor, weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``[F.linear(x, w_i, b_i) for each i]`` computed as one matmul (``FusedColumnLinear``).

    Shapes: ``x [..., in]``, ``weights[i] [out_i, in]``, ``biases[i] [out_i]``; returns one
    ``[..., out_i]`` per weight, in the given order (column views of one ``[..., sum out_i]``).
    """
    order = tuple(range(len(weights)))
    y = FusedColumnLinear.apply(x, order, *weights, *(biases or ()))
    out: list[torch.Tensor | None] = [None] * len(weights)
    for i, part in zip(order, y.split([weights[i].shape[0] for i in order], dim=-1)):
        out[i] = part
    return out


def fused_column_forward(layers: Sequence, x: torch.Tensor) -> list[torch.Tensor]:
    """The local matmuls of several ``ColumnParallelLinear`` layers sharing one input, fused.

    ``x``: ``[b, s, in]``, already made ready by ``enter_tp_region`` (the sequence all-gather, or
    copy-to-tp, happens once, before). Returns ``[b, s, out_i/tp]`` per layer, equal to each layer's
    ``local_forward(x)``.

    Raises:
        ValueError: a layer gathers its output, the layers differ in ``in_features``, or some have a
            bias and some not.
    """
    if any(layer.gather_output for layer in layers) or len({layer.in_features for layer in layers}) != 1:
        raise ValueError("fused column-parallel layers must share in_features and keep their outputs split "
                         f"(gather_output=False); got {[(m.in_features, m.gather_output) for m in layers]}")
    biases = [layer.bias for layer in layers]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("fused column-parallel layers must all have a bias or none")
    if torch.compiler.is_compiling():
        # traced, the fused weight is a torch.cat of the parameters that AOT autograd keeps for backward
        # (one copy of every fused weight per block until its backward); separate matmuls keep none
        return [layer.local_forward(x) for layer in layers]
    return fused_linear(x, [layer.weight for layer in layers], None if biases[0] is None else biases)
