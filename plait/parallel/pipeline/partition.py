"""Cutting a model's layer list into pipeline stages, and which stages are this rank's.

A model is a flat list of ``num_layers + 2`` items: 0 = embedding, 1..L = transformer blocks,
L+1 = head (``plait.layers.stages.build_stage_modules`` builds a plait model's chunks from a partition).
With ``p`` pipeline ranks and ``v`` model chunks per rank there are ``p*v`` virtual stages; which rank
and chunk hold stage ``s`` is the schedule's placement (``plait.parallel.pipeline.schedules.stage_of``: ``c*p + r``
for chunk ``c`` on rank ``r``, Narayanan et al., SC'21, Sec. 2.2.2, or the "v" shape of "zb-v"). A partition
gives each virtual stage a contiguous, non-empty range ``[start, stop)`` of items.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from plait.parallel.pipeline.schedules import stage_of

METHODS = ("uniform", "parameters")


def _check_count(num_items: int, p: int, v: int) -> None:
    for name, value in (("num_items", num_items), ("p", p), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"partition_layers: {name} must be a positive integer, got {value!r}")
    if num_items < p * v:
        raise ValueError(
            f"cannot split {num_items} layers (embedding + blocks + head) into p x v = "
            f"{p} x {v} = {p * v} pipeline stages of at least one layer each; use at most "
            f"{num_items} stages (lower pp or virtual stages) or add blocks"
        )


def _uniform(n: int, stages: int) -> list[int]:
    """Boundaries with part sizes differing by at most one, the larger parts spread evenly."""
    return [(s * n + stages // 2) // stages for s in range(stages)] + [n]


def _balanced(weights: Sequence[float], stages: int) -> list[int]:
    """Boundaries minimizing the largest part's summed weight (exact dynamic programme, O(S n^2)).

    Ties between equally good cuts go to the cut that leaves more items to the later stages, so
    the result is deterministic."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][i]: first i items in k parts
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def partition_layers(
    num_items: int,
    p: int,
    v: int = 1,
    method: str | Sequence[int] = "uniform",
    weights: Sequence[float] | None = None,
) -> list[tuple[int, int]]:
    """Split ``num_items`` layers into ``p*v`` contiguous virtual stages.

    Args:
        num_items: layers in the model's flat list (``num_layers + 2`` for a plait model).
        p: pipeline ranks; v: model chunks per rank.
        method: "uniform" (layer counts differ by at most one), "parameters" (minimize the largest
            stage's summed ``weights``, e.g. ``plait.layers.stages.layer_parameter_counts``),
            or explicit boundaries ``[0, b1, ..., num_items]`` (``p*v + 1`` increasing numbers;
            uneven splits allowed).
        weights: per-layer cost, ``len == num_items``; required by "parameters".

    Returns:
        ``[(start, stop), ...]`` in virtual-stage order (stage 0 first).

    Raises:
        ValueError: fewer layers than ``p*v``; unknown method; "parameters" without weights of
            the right length; boundaries that are not ``p*v + 1`` strictly increasing numbers
            from 0 to ``num_items``. Each message names the numbers and the fix.
    """
    _check_count(num_items, p, v)
    stages = p * v
    if isinstance(method, str):
        if method == "uniform":
            bounds = _uniform(num_items, stages)
        elif method == "parameters":
            if weights is None or len(weights) != num_items:
                got = "none" if weights is None else f"{len(weights)}"
                raise ValueError(
                    f"method 'parameters' needs one weight per layer ({num_items}), got {got}; "
                    f"pass weights=layer_parameter_counts(config) (plait.layers.stages)"
                )
            bounds = _balanced(weights, stages)
        else:
            raise ValueError(
                f"unknown partition method {method!r}; use one of {METHODS} or a list of "
                f"boundaries [0, ..., {num_items}]"
            )
    else:
        bounds = _explicit(method, num_items, stages)
    return [(bounds[s], bounds[s + 1]) for s in range(stages)]


def _explicit(method: Sequence[int], num_items: int, stages: int) -> list[int]:
    """Given boundaries as ints; ValueError unless ``stages + 1`` of them rise strictly from 0 to ``num_items``."""
    bounds = [int(b) for b in method]
    if len(bounds) != stages + 1:
        raise ValueError(
            f"explicit partition needs p x v + 1 = {stages + 1} boundaries for {stages} "
            f"stages, got {len(bounds)}: {bounds}"
        )
    if bounds[0] != 0 or bounds[-1] != num_items:
        raise ValueError(
            f"explicit partition boundaries must start at 0 and end at {num_items} (the "
            f"number of layers) to cover the whole model, got {bounds}"
        )
    bad = [i for i in range(stages) if bounds[i + 1] <= bounds[i]]
    if bad:
        i = bad[0]
        raise ValueError(
            f"explicit partition boundaries must strictly increase (every stage needs at "
            f"least one layer), but stage {i} is [{bounds[i]}, {bounds[i + 1]}) in {bounds}"
        )
    return bounds


def stage_layers(
    parts: list[tuple[int, int]], p: int, rank: int, shape: str = "loop"
) -> list[range]:
    """Layer ranges of the chunks held by pipeline ``rank``: chunk ``c`` is stage ``stage_of(rank, c, p,
    shape)`` ("loop": ``c*p + rank``). Raises ValueError for an unknown ``shape``."""
    return [range(*parts[stage_of(rank, c, p, shape)]) for c in range(len(parts) // p)]
