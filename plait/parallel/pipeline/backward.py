"""Zero-bubble backward split: the input-gradient pass (BI) now, the weight-gradient pass (BW) later
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 2: for ``y = x W^T``, BI computes
``dx = dy W`` and keeps ``dy``; BW computes ``dW = dy^T x``).

Works on a plain autograd graph, no change to the layers: ``backward_input(output, grad_output, ...)``
walks the graph once, asks autograd for the input gradient and the gradients flowing into every GEMM
node (``GEMM_NODES``), and returns a ``PendingWeightGrad``; ``backward_weight(pending)`` (or
``weight_gradients`` + ``run_tails``) computes the GEMMs' ``dW`` from the captured ``dy``
(``plait.parallel.pipeline.weight_grad``) and accumulates ``.grad`` through one engine call, so
gradient hooks fire as in a plain backward. A graph the cut does not fit falls back to re-running the
whole backward in BW (correct, at the cost of a full B). The walk, costs, memory and fallback:
``docs/pipeline.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils import checkpoint as _checkpoint

from plait.parallel.pipeline.weight_grad import plan

#: weight nodes whose parameter-side work (a GEMM) BI defers to BW; every other weight node (norms, bias
#: adds, element-wise scales, any op without a formula here) computes its parameter gradient in BI
GEMM_NODES = ("MmBackward0", "AddmmBackward0")


@dataclass
class PendingWeightGrad:
    """What BI leaves for BW of one (micro-batch, chunk).

    Attributes:
        output, grad_output: the stage output and its gradient (kept only for the full-backward
            fallback and the first stage; None after a successful split).
        nodes: per weight node, ``(node, [(slot, dy)], [(i, child, k)], fn)``: the captured
            gradients of its output slots, its parameter-side outputs ``i`` with the child edge
            ``(child, k)`` each feeds, and ``fn(dy)`` computing them (``weight_grad.plan``; None:
            run the node through the engine).
        ready: ``[(GradientEdge, gradient)]``: parameter-side gradients BI computed already (the cheap,
            non-GEMM weight nodes), fed into the parameters by BW's one engine call.
        split: True when BW runs only the weight halves (see the module docstring).
    """

    output: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None
    nodes: list = field(default_factory=list)
    ready: list = field(default_factory=list)
    split: bool = False


def _analyse(root, target, root_slot: int):
    """Weight nodes of the graph below ``root`` w.r.t. the input-gradient node ``target``.

    One walk reads every node's ``next_functions`` once (the first read of a node wraps it in a
    Python object: the main host cost) and records parents; the input path is then
    the ancestors of ``target``, and the weight nodes are the input-path parents of the nodes off it.

    Returns:
        ``(weight_nodes, simple)``: ``[(node, slots, [(i, child, k)])]`` for every input-path node
        with parameter-side outputs ``i`` (feeding input ``k`` of ``child``), ``slots`` being its
        output slots that receive a gradient; ``simple`` is False when a parameter-side child has
        more than one in-edge. ``None`` when ``target`` is not reachable from ``root``.
    """
    kids = {}
    parents: dict = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        edges = kids[node] = node.next_functions
        for child, _ in edges:
            if child is not None:
                plist = parents.get(child)
                if plist is None:
                    parents[child] = [node]
                    stack.append(child)
                else:
                    plist.append(node)
    if target not in parents or target is root:
        return None
    on_path = {target}
    frontier = [target]
    while frontier:
        for parent in parents[frontier.pop()]:
            if parent not in on_path:
                on_path.add(parent)
                frontier.append(parent)
    weight: dict = {}  # weight node -> None, in a deterministic order
    simple = True
    for child, plist in parents.items():
        if child in on_path:
            continue
        hits = [p for p in plist if p in on_path]
        if hits:
            simple = simple and len(plist) == 1
            weight.update(dict.fromkeys(hits))
    weight_nodes = []
    for node in weight:
        side = [
            (i, c, k) for i, (c, k) in enumerate(kids[node]) if c is not None and c not in on_path
        ]
        slots = {root_slot} if node is root else set()
        for parent in dict.fromkeys(parents[node]):
            slots.update(k for c, k in kids[parent] if c is node)
        weight_nodes.append((node, sorted(slots), side))
    return weight_nodes, simple


def backward_input(
    output: torch.Tensor, grad_output: torch.Tensor | None, stage_input: torch.Tensor | None
) -> tuple[torch.Tensor | None, PendingWeightGrad]:
    """BI: the gradient w.r.t. ``stage_input`` only; returns it and the state BW needs.

    Args:
        output: the stage output (a scalar loss on the last stage, else ``[b, s(/tp), h]``).
        grad_output: gradient of the output (same shape), or None for a scalar loss.
        stage_input: the leaf the stage ran on (``requires_grad``), or None on the first stage.

    Returns:
        ``(input_grad, pending)``; ``input_grad`` is None when there is no stage input.
    """
    if stage_input is None or output.grad_fn is None:
        return None, PendingWeightGrad(output, grad_output)
    root = output.grad_fn
    target = get_gradient_edge(stage_input).node
    found = _analyse(root, target, output.output_nr)
    if found is None or not found[1] or not found[0]:
        (grad,) = torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)
        return grad, PendingWeightGrad(output, grad_output)
    deferred, early = [], []
    for node, ks, side in found[0]:
        (deferred if type(node).__name__ in GEMM_NODES and ks == [0] else early).append(
            (node, ks, side)
        )
    # Formulas for BW, set up before the engine frees anything: when every deferred node has one
    # (reading plain saved tensors now), BI need not retain the graph and its other activations
    # (attention, activation functions, norms) are freed here instead of after BW.
    plans = [plan(n, side) for n, _, side in deferred]
    retain = not all(p is not None and p[1] for p in plans)
    edges = [GradientEdge(n, k) for n, ks, _ in deferred for k in ks]
    tails = [GradientEdge(c, k) for _, _, side in early for _, c, k in side]
    grads = torch.autograd.grad(
        output, [stage_input, *edges, *tails], grad_output, retain_graph=retain, allow_unused=True
    )
    it = iter(grads[1 : 1 + len(edges)])
    nodes = []
    for (node, ks, side), p in zip(deferred, plans):
        captured = [(k, g) for k in ks if (g := next(it)) is not None]
        if captured:
            nodes.append((node, captured, side, None if p is None else p[0]))
    ready = [(e, g) for e, g in zip(tails, grads[1 + len(edges) :]) if g is not None]
    return grads[0], PendingWeightGrad(nodes=nodes, ready=ready, split=True)


def backward_weight(pending: PendingWeightGrad) -> None:
    """BW: accumulate the parameter gradients left by :func:`backward_input` into ``.grad``."""
    if not pending.split:
        torch.autograd.backward(pending.output, pending.grad_output)
        return
    _in_exec_group(lambda: run_tails(*_weight_halves(pending)))


def weight_gradients(pending: PendingWeightGrad) -> tuple[list, list]:
    """BW's kernels without the accumulation: the parameter-side gradients of a split ``pending``
    (``split`` True) as ``(edges, grads)`` for :func:`run_tails` (``plait.parallel.pipeline.graphs``
    captures this part in a CUDA graph and runs the tails after each replay)."""
    return _in_exec_group(lambda: _weight_halves(pending))


def _in_exec_group(fn):
    group = getattr(_checkpoint, "GraphExecGroup", None)
    if group is None or torch._C._get_graph_exec_group() is not None:
        return fn()
    with (
        group()
    ):  # a checkpointed region is recomputed once for all of BW, not once per saved tensor
        return fn()


def _weight_halves(pending: PendingWeightGrad) -> tuple[list, list]:
    tails, tail_grads = [e for e, _ in pending.ready], [g for _, g in pending.ready]
    for node, captured, side, fn in pending.nodes:
        if (
            fn is not None
        ):  # plait.parallel.pipeline.weight_grad: the autograd formula on the saved tensors
            grads = fn(captured[0][1])
        else:  # any other node: run it alone through the engine (the graph was retained)
            outs = [GradientEdge(node, k) for k, _ in captured]
            grads = torch.autograd.grad(
                outs,
                [GradientEdge(c, k) for _, c, k in side],
                [g for _, g in captured],
                allow_unused=True,
            )
        for (_, child, k), g in zip(side, grads):
            if g is not None:
                child, k, g = _past_transpose(child, k, g)
                tails.append(GradientEdge(child, k))
                tail_grads.append(g)
    pending.nodes, pending.ready = [], []
    return tails, tail_grads


def _past_transpose(child, k: int, grad: torch.Tensor):
    """``TBackward0 -> AccumulateGrad`` (a weight used as ``W.t()``): give ``AccumulateGrad`` the transposed
    gradient directly, the same ``.t()`` view the engine's ``TBackward0`` would pass on (one node less to run
    per GEMM weight; ``.grad`` and its hooks are unchanged)."""
    if type(child).__name__ == "TBackward0":
        ((acc, j),) = child.next_functions
        if acc is not None and type(acc).__name__ == "AccumulateGrad":
            return acc, j, grad.t()
    return child, k, grad


def run_tails(edges: list, grads: list, keep_graph: bool = False) -> None:
    """One engine call from ``edges`` into the parameters (``AccumulateGrad`` and its hooks fire);
    ``keep_graph``: keep the tail nodes' saved tensors, to run the same tails again (CUDA-graph replays).

    Every gradient already has its edge's shape and dtype (``weight_grads`` applies the engine's
    own ``validate_outputs`` rules), so ``torch.autograd.backward``'s Python re-check of each one is
    skipped where torch exposes the engine entry point it wraps.
    """
    if not edges:
        return
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        torch.autograd.backward(edges, grads, retain_graph=keep_graph)
    else:
        run(
            tuple(edges),
            tuple(grads),
            keep_graph,
            False,
            (),
            allow_unreachable=True,
            accumulate_grad=True,
        )
