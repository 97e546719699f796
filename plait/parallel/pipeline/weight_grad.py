"""Weight-side gradients of single autograd nodes, computed from their saved tensors (the W pass of
``plait.parallel.pipeline.backward``: e.g. ``dW = dy^T x`` for the ``MmBackward0`` of ``y = x W^T``).

The formulas are PyTorch's own (``tools/autograd/derivatives.yaml``, ``FunctionsManual.cpp``) with the
same kernels and operand layouts, so results are bitwise the autograd engine's, without one engine call
per node. Covered: ``MmBackward0``, ``AddmmBackward0``, ``MulBackward0``, ``AddBackward0``,
``NativeLayerNormBackward0``, and any ``torch.autograd.Function`` defining ``plait_gradients(ctx, saved,
grad, needs)`` (plait's RMSNorm). Real, strided tensors only.

``plan(node, side)`` runs before the input-gradient pass and returns ``(grads_fn, eager)`` or None: eager
when no saved tensor it needs has saved-tensor hooks, so that pass may free the graph. More:
``docs/pipeline.md``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Per node type and output index: the saved tensors (``_saved_<name>``) its formula reads.
_NEEDS = {
    "MmBackward0": (("mat2",), ("self",)),
    "AddmmBackward0": ((), ("mat2",), ("mat1",)),
    "MulBackward0": (("other",), ("self",)),
    "AddBackward0": ((), ()),
}
_LAYER_NORM = "NativeLayerNormBackward0"
_LAYER_NORM_NEEDS = ("input", "result1", "result2", "weight", "bias")


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
    if (
        strides[0] == 1 and strides[1] == sizes[0]
    ):  # e.g. mat2 = W.t(): the gradient comes as dW.t()
        return _times(grad.t().mm(mat1).t(), alpha)
    return _times(mat1.t().mm(grad), alpha)


def _fitter(child, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The engine's ``validate_outputs`` for one edge: sum to the input's shape, cast its dtype."""
    meta = child._input_metadata[k]
    shape, dtype = tuple(meta.shape), meta.dtype

    def fit(grad: torch.Tensor) -> torch.Tensor:
        if tuple(grad.shape) != shape:
            grad = grad.sum_to_size(shape)
        return grad if grad.dtype == dtype else grad.to(dtype)

    return fit


def _formula(node, name: str, i: int, get: Callable, child, k: int) -> Callable:
    """``dy -> gradient of output i`` (feeding input ``k`` of ``child``) for one covered node;
    ``get(attr)`` yields a saved tensor. Matrix products need no fitting: mm keeps the operand's
    shape and dtype."""
    if name == "MmBackward0":
        if i == 0:
            sizes, strides = node._saved_self_sym_sizes, node._saved_self_sym_strides
            return lambda dy: _mat1_grad(dy, get("mat2"), sizes, strides, 1)
        sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
        return lambda dy: _mat2_grad(dy, get("self"), sizes, strides, 1)
    if name == "AddmmBackward0":
        if i == 0:
            beta, fit = node._saved_beta, _fitter(child, k)
            return lambda dy: fit(_times(dy, beta))
        alpha = node._saved_alpha
        if i == 1:
            sizes, strides = node._saved_mat1_sym_sizes, node._saved_mat1_sym_strides
            return lambda dy: _mat1_grad(dy, get("mat2"), sizes, strides, alpha)
        sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
        return lambda dy: _mat2_grad(dy, get("mat1"), sizes, strides, alpha)
    fit = _fitter(child, k)
    if name == "MulBackward0":
        other = "other" if i == 0 else "self"
        return lambda dy: fit(dy * get(other))
    alpha = 1 if i == 0 else node._saved_alpha  # AddBackward0
    return lambda dy: fit(_times(dy, alpha))


def _layer_norm(node, side, get) -> Callable | None:
    """Weight and bias gradients from one ``native_layer_norm_backward`` (input gradient masked off,
    as the engine masks it when only these outputs are needed)."""
    slots = [i for i, _, _ in side]
    if 0 in slots:
        return None
    shape, mask = list(node._saved_normalized_shape), [False, 1 in slots, 2 in slots]
    fits = [_fitter(child, k) for _, child, k in side]

    def grads(dy):
        out = torch.ops.aten.native_layer_norm_backward(
            dy,
            get("input"),
            shape,
            get("result1"),
            get("result2"),
            get("weight"),
            get("bias"),
            mask,
        )
        return [fit(out[i]) for fit, i in zip(fits, slots)]

    return grads


def _function_plan(node, function, side: list) -> tuple[Callable, bool] | None:
    """``plan`` for a custom autograd.Function node whose class computes its own gradients from its
    saved tensors (``function.plait_gradients(ctx, saved, grad, needs)``)."""
    eager = all(r.unpack_hook is None for r in node._raw_saved_tensors)
    if eager:
        saved = node.saved_tensors
        if not all(_usable(t) for t in saved):
            return None
        load = lambda: saved  # noqa: E731
    else:
        load = lambda: node.saved_tensors  # noqa: E731
    fits = [(i, _fitter(child, k)) for i, child, k in side]
    needs = tuple(any(i == j for i, _, _ in side) for j in range(len(node.next_functions)))

    def grads(dy):
        out = function.plait_gradients(node, load(), dy, needs)
        return [fit(out[i]) for i, fit in fits]

    return grads, eager


def _plain(node, attr: str) -> bool:
    """True when ``_saved_<attr>`` has no saved-tensor hooks (reading it early is free)."""
    try:
        return getattr(node, "_raw_saved_" + attr).unpack_hook is None
    except (AttributeError, RuntimeError):
        return False


def _usable(t) -> bool:
    return t is None or (t.layout == torch.strided and not t.is_complex())


def plan(node, side: list) -> tuple[Callable, bool] | None:
    """A function computing ``node``'s parameter-side gradients from the gradient of its output.

    Args:
        node: an autograd node with one output, before the input-gradient pass runs it.
        side: ``[(i, child, k)]``: the node's ``i``-th output (``node.next_functions[i]``) feeds
            input ``k`` of ``child``.

    Returns:
        ``(fn, eager)``: ``fn(dy)`` returns one gradient per entry of ``side`` (shaped and typed
        like that child's input); ``eager`` when the saved tensors were read now, so the graph
        need not be retained for ``fn``. None when the node type or its tensors are not covered.
    """
    name = type(node).__name__
    function = getattr(node, "_forward_cls", None)
    if hasattr(function, "plait_gradients"):
        return _function_plan(node, function, side)
    if name == _LAYER_NORM:
        needs = _LAYER_NORM_NEEDS
    elif name in _NEEDS:
        needs = tuple({a: None for i, _, _ in side for a in _NEEDS[name][i]})
    else:
        return None
    eager = all(_plain(node, a) for a in needs)
    if eager:
        saved = {a: getattr(node, "_saved_" + a) for a in needs}
        if not all(_usable(t) for t in saved.values()):
            return None
        get = saved.__getitem__
    else:

        def get(attr):
            t = getattr(node, "_saved_" + attr)
            if not _usable(t):
                raise RuntimeError(
                    f"zero-bubble weight pass: {name}._saved_{attr} is not a real strided tensor"
                )
            return t

    if name == _LAYER_NORM:
        fn = _layer_norm(node, side, get)
        return None if fn is None else (fn, eager)
    fns = [_formula(node, name, i, get, child, k) for i, child, k in side]
    return (lambda dy: [f(dy) for f in fns]), eager
