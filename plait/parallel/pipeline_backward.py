"""Zero-bubble backward split: the input-gradient pass (BI) now, the weight-gradient pass (BW) later.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), Sec. 2: a stage's backward is two
computations, ``dL/dx`` (needed at once by the previous stage) and ``dL/dW`` (needed only by the
optimizer step). For a linear layer ``y = x W^T`` they are ``dx = dy W`` and ``dW = dy^T x``; BI
runs the first, keeps ``dy``, and BW later runs the second.

How this is done on a plain autograd graph, with no change to the layers:

1. Walk the graph from the stage output. A node is on the *input path* when the stage input's
   gradient edge is reachable from it. A *weight node* is an input-path node with at least one
   child edge that leaves the input path (towards parameters only), e.g. ``MmBackward`` of
   ``x @ W^T`` whose children are the path to ``x`` and ``TBackward -> AccumulateGrad(W)``.
2. BI: ``torch.autograd.grad(output, [input] + [gradient edges into every weight node])`` with the
   graph retained. The engine runs only what the input gradient needs, so each weight node
   computes its input-side output only (``dx = dy W``) and the parameter-side outputs are skipped;
   the gradients flowing *into* the weight nodes (``dy``) are captured.
3. BW: per weight node, ``torch.autograd.grad`` from its captured ``dy`` to its parameter-side child
   edges (runs only that node's ``dW = dy^T x`` part; graph cut at the edges, so nothing
   upstream is revisited), then one ``torch.autograd.backward`` from all those edges into the
   parameters (runs the parameter-only tails: transposes, tp all-reduces of sequence-parallel
   weights, ``AccumulateGrad``, so gradient hooks fire as in a plain backward).

Cost: no recomputation of either the forward or the input-gradient half; BW's extra work is one
engine call per weight node (about 8 per transformer block: Python/engine overhead of tens of
microseconds each) and a graph walk in BI. Memory: the captured ``dy`` of every weight node is
held from BI to BW (activation-sized, as in the paper's W pass), on top of the retained graph.

Fallback: when the graph does not have the simple shape the cut relies on (a parameter-side node
reached from more than one edge, e.g. a weight reused by two ops that feed each other), BW instead
re-runs the whole backward from the output with the retained graph (correct, but it repeats the
input-gradient half: BW then costs a full B). The first stage (no input gradient) always runs its
whole backward in BW, and BI there is empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class PendingWeightGrad:
    """What BI leaves for BW of one (micro-batch, chunk).

    Attributes:
        output, grad_output: the stage output and its gradient (kept only for the full-backward
            fallback and the first stage; None after a successful split).
        nodes: per weight node, (captured ``[(slot, dy)]``, parameter-side child edges).
        split: True when BW runs only the weight halves (see the module docstring).
    """

    output: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None
    nodes: list = field(default_factory=list)
    split: bool = False


def _walk(root) -> tuple[list, dict]:
    """Nodes reachable from ``root`` (children before parents) and in-edge counts per node."""
    order, seen, indeg = [], set(), {}
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is not None:
                indeg[child] = indeg.get(child, 0) + 1
                if child not in seen:
                    stack.append((child, False))
    return order, indeg


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None,
                   stage_input: torch.Tensor | None) -> tuple[torch.Tensor | None, PendingWeightGrad]:
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
    order, indeg = _walk(root)
    target = get_gradient_edge(stage_input).node
    on_path = set()
    for node in order:  # children first, so one pass decides reachability
        if node is target or any(c in on_path for c, _ in node.next_functions if c is not None):
            on_path.add(node)
    slots: dict = {root: {output.output_nr}}
    for node in order:
        if node in on_path:
            for child, k in node.next_functions:
                if child is not None:
                    slots.setdefault(child, set()).add(k)
    weight_nodes, simple = [], True
    for node in order:
        if node not in on_path or node is target:
            continue
        side = [(c, k) for c, k in node.next_functions if c is not None and c not in on_path]
        if side:
            simple = simple and all(indeg.get(c, 0) == 1 for c, _ in side)
            weight_nodes.append((node, sorted(slots[node]), side))
    if not simple or not weight_nodes:
        (grad,) = torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)
        return grad, PendingWeightGrad(output, grad_output)
    edges = [GradientEdge(n, k) for n, ks, _ in weight_nodes for k in ks]
    grads = torch.autograd.grad(output, [stage_input, *edges], grad_output, retain_graph=True,
                                allow_unused=True)
    it = iter(grads[1:])
    nodes = []
    for node, ks, side in weight_nodes:
        captured = [(k, g) for k in ks if (g := next(it)) is not None]
        if captured:
            nodes.append((node, captured, side))
    return grads[0], PendingWeightGrad(nodes=nodes, split=True)


def backward_weight(pending: PendingWeightGrad) -> None:
    """BW: accumulate the parameter gradients left by :func:`backward_input` into ``.grad``."""
    if not pending.split:
        torch.autograd.backward(pending.output, pending.grad_output)
        return
    tails, tail_grads = [], []
    for node, captured, side in pending.nodes:
        outs = [GradientEdge(node, k) for k, _ in captured]
        grads = torch.autograd.grad(outs, [GradientEdge(c, k) for c, k in side], [g for _, g in captured],
                                    allow_unused=True)
        for (child, k), g in zip(side, grads):
            if g is not None:
                tails.append(GradientEdge(child, k))
                tail_grads.append(g)
    pending.nodes = []
    if tails:
        torch.autograd.backward(tails, tail_grads)
