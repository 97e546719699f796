"""Stage-3 units: the modules whose parameters ``plait.zero.stage3.ParamGatherer`` gathers together, the
recorded order they run in (for prefetch), and whether a backward pass accumulates into their parameters
(the zero-bubble split). See ``plait.zero.stage3`` for how units are gathered and released."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from plait.zero.flat import Segment


@dataclass(eq=False)
class Unit:
    """A module whose forward needs ``params`` (non-persistent, sharded) gathered."""

    index: int
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    segments: list[Segment] = field(default_factory=list)
    gathered: bool = False  # held by a forward or a backward now (``ParamGatherer.gather``)
    remaining: int = 0  # gradients still to arrive in this backward pass
    deferred: int = (
        0  # input-gradient passes (zero-bubble BI) whose weight-gradient pass is still to come
    )


def build_units(root: nn.Module, sharded: set[int], units: list[nn.Module] | None) -> list[Unit]:
    """Units over ``root`` whose params are those with ``id`` in ``sharded`` (``plait.zero.stage3``, "Units").

    Raises:
        ValueError: a module in ``units`` is not a submodule of ``root``.
    """
    names = {id(m): n for n, m in root.named_modules()}
    if units is None:
        chosen = [
            m
            for _, m in root.named_modules()
            if any(id(p) in sharded for p in m.parameters(recurse=False))
        ]
    else:
        missing = [type(m).__name__ for m in units if id(m) not in names]
        if missing:
            raise ValueError(
                f"stage-3 units {missing} are not submodules of the model; pass modules "
                "from model.modules() (e.g. the transformer blocks)"
            )
        chosen = list(units) + ([root] if all(m is not root for m in units) else [])
    chosen_ids = {id(m) for m in chosen}
    params: dict[int, list[nn.Parameter]] = {id(m): [] for m in chosen}
    seen_modules: set[int] = set()

    def visit(m: nn.Module, current: nn.Module | None) -> None:
        if id(m) in seen_modules:
            return
        seen_modules.add(id(m))
        if id(m) in chosen_ids:
            current = m
        if current is not None:
            bucket = params[id(current)]
            for p in m.parameters(recurse=False):
                if id(p) in sharded and all(p is not q for q in bucket):
                    bucket.append(p)
        for child in m.children():
            visit(child, current)

    visit(root, None)
    ordered = [m for _, m in root.named_modules() if id(m) in chosen_ids and params[id(m)]]
    return [Unit(i, names[id(m)] or "<root>", m, params[id(m)]) for i, m in enumerate(ordered)]


class UnitOrder:
    """Records the unit order of the first pass, then predicts the next units on later passes.

    A pass begins at ``start()`` (the root module's forward, the end of a backward) or, where nothing calls
    it, when a unit runs again: a pipeline engine calls its stage chunks, never the root, so the first
    repeated unit ends the recording (the order never grows past the number of units) and every pass that
    begins at the recorded first unit is predicted from there."""

    def __init__(self):
        self.order: list[int] = []
        self.recording = True
        self.cursor = 0

    def start(self) -> None:
        self.cursor = 0

    def stop_recording(self) -> None:
        if self.order:
            self.recording = False

    def advance(self, index: int) -> list[int]:
        """Note that unit ``index`` runs now; return the predicted units after it."""
        if self.recording:
            if index not in self.order:
                self.order.append(index)
                return []
            self.recording, self.cursor = False, 0  # a unit ran again: the first pass is over
        if 0 <= self.cursor < len(self.order) and self.order[self.cursor] == index:
            self.cursor += 1
        elif self.order[0] == index:  # a new pass from the first unit, without start()
            self.cursor = 1
        else:
            self.cursor = -1  # off the recorded path: no more prefetch this pass
            return []
        return self.order[self.cursor :]


def ahead(units: list[Unit], upcoming: list[int], bound: int) -> list:
    """The segments to all-gather ahead of the units ``upcoming`` (indices in the recorded order): whole
    units while fewer than ``bound`` elements are taken, the unit that crosses the bound included (so the
    next unit always is), each segment once (a tied parameter's segment belongs to several units)."""
    out, seen = [], set()
    for index in upcoming:
        if bound <= 0:
            break
        for seg in units[index].segments:
            if id(seg) not in seen:
                seen.add(id(seg))
                out.append(seg)
                bound -= seg.padded
    return out


def accumulates(params: list[nn.Parameter]) -> bool:
    """Whether the running autograd pass (call it inside backward) will accumulate a gradient into one of
    ``params``, i.e. run its ``AccumulateGrad`` (asked of autograd's engine, as ``register_multi_grad_hook``
    does). False for a zero-bubble input-gradient pass: ``torch.autograd.grad`` w.r.t. the stage input and
    edges inside the graph; a parameter whose gradient such a pass returns (its ``AccumulateGrad`` edge among
    the inputs: captured, not run) does not count either."""
    for p in params:
        if not p.requires_grad:
            continue
        try:
            if torch._C._will_engine_execute_node(get_gradient_edge(p).node):
                return True
        except (
            RuntimeError
        ):  # "a leaf node was passed ... running autograd.grad()": captured, not accumulated
            continue
    return False
