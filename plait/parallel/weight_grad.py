"""Weight-side gradients of single autograd nodes, computed from their saved tensors.

The zero-bubble W pass (``plait.parallel.pipeline_backward``) must compute, for a node such as the
``MmBackward0`` of ``y = x W^T``, only the parameter-side output ``dW = dy^T x`` from a gradient
``dy`` captured earlier. Running each node through the autograd engine costs one engine call per
node (tens of microseconds of host time each, ~9 per transformer block), so for the node types of
plait's layers the formula is applied here directly, on the node's saved tensors, exactly as
PyTorch's autograd formulas (``tools/autograd/derivatives.yaml``, ``FunctionsManual.cpp``) apply
it: same kernels, same operand layouts, so the result is bitwise the engine's.

``weight_grads(node, dy, slots)`` returns one gradient per requested input slot, already reduced
and cast as the engine's ``validate_outputs`` would (``sum_to`` the input's shape, then its
dtype), or None when the node type or its operands are not covered (the caller then runs the
node through the engine). Covered: ``MmBackward0``, ``AddmmBackward0`` (``F.linear``),
``MulBackward0`` (RMSNorm weight), ``AddBackward0`` (bias add), ``NativeLayerNormBackward0``.

Cost: the same matmul / reduction kernels the engine would launch, plus a few microseconds of
Python per node.
"""
from __future__ import annotations

import torch


def _times(t: torch.Tensor, s) -> torch.Tensor:
    """``maybe_multiply``: ``t`` unchanged for a factor of 1 (no kernel), else ``t * s``."""
    return t if s == 1 else t * s


def _mat1_grad(grad, mat2, sizes, strides, alpha):
    """``mm_mat1_backward``: gradient of ``mat1`` in ``mat1 @ mat2`` (layout follows ``mat1``)."""
    if strides[0] == 1 and strides[1] == sizes[0]:  # column-major mat1: column-major gradient
        return _times(mat2.mm(grad.t()).t(), alpha)
    return _times(grad.mm(mat2.t()), alpha)


def _mat2_grad(grad, mat1, sizes, strides, alpha):
    """``mm_mat2_backward``: gradient of ``mat2`` in ``mat1 @ mat2`` (layout follows ``mat2``)."""
    if strides[0] == 1 and strides[1] == sizes[0]:  # e.g. mat2 = W.t(): the gradient comes as dW.t()
        return _times(grad.t().mm(mat1).t(), alpha)
    return _times(mat1.t().mm(grad), alpha)


def _fit(grad: torch.Tensor, child, k: int) -> torch.Tensor:
    """The engine's ``validate_outputs`` for one edge: sum to the input's shape, cast its dtype."""
    meta = child._input_metadata[k]
    shape = tuple(meta.shape)
    if tuple(grad.shape) != shape:
        grad = grad.sum_to_size(shape)
    if grad.dtype != meta.dtype:
        grad = grad.to(meta.dtype)
    return grad


# Per node type: (node, dy, i, child, k) -> gradient of output i (final: shaped and typed like input
# k of child). Matrix products need no reduction or cast: mm keeps the operand's shape and dtype.

def _mm(node, grad, i, child, k):
    if i == 0:
        return _mat1_grad(grad, node._saved_mat2, node._saved_self_sym_sizes, node._saved_self_sym_strides, 1)
    return _mat2_grad(grad, node._saved_self, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides, 1)


def _addmm(node, grad, i, child, k):
    if i == 0:
        return _fit(_times(grad, node._saved_beta), child, k)
    if i == 1:
        return _mat1_grad(grad, node._saved_mat2, node._saved_mat1_sym_sizes, node._saved_mat1_sym_strides,
                          node._saved_alpha)
    return _mat2_grad(grad, node._saved_mat1, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides,
                      node._saved_alpha)


def _mul(node, grad, i, child, k):
    return _fit(grad * (node._saved_other if i == 0 else node._saved_self), child, k)


def _add(node, grad, i, child, k):
    return _fit(grad if i == 0 else _times(grad, node._saved_alpha), child, k)


_HANDLERS = {"MmBackward0": _mm, "AddmmBackward0": _addmm, "MulBackward0": _mul, "AddBackward0": _add}


def _layer_norm(node, grad, side):
    slots = [i for i, _, _ in side]
    if 0 in slots:
        return None
    out = torch.ops.aten.native_layer_norm_backward(
        grad, node._saved_input, list(node._saved_normalized_shape), node._saved_result1,
        node._saved_result2, node._saved_weight, node._saved_bias, [False, 1 in slots, 2 in slots])
    return [_fit(out[i], child, k) for i, child, k in side]


def weight_grads(node, dy: torch.Tensor, side: list) -> list | None:
    """Gradients of ``node``'s parameter-side inputs from the gradient ``dy`` of its output.

    Args:
        node: an autograd node with one output (its saved tensors still held).
        dy: the gradient flowing into it (shape of its forward output).
        side: ``[(i, child, k)]``: compute the node's ``i``-th output (``node.next_functions[i]``),
            which feeds input ``k`` of ``child``.

    Returns:
        One tensor per entry of ``side`` (shaped and typed like that child's input), or None
        when this node is not covered here.
    """
    if dy.layout != torch.strided or dy.is_complex():
        return None
    name = type(node).__name__
    if name == "NativeLayerNormBackward0":
        return _layer_norm(node, dy, side)
    fn = _HANDLERS.get(name)
    return None if fn is None else [fn(node, dy, i, child, k) for i, child, k in side]
