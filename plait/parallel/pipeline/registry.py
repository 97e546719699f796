"""The pipeline schedules by name: their generators, the stage placement each assumes, and ``get_schedule``.

The generators of the fixed orders live in :mod:`plait.parallel.pipeline.schedules`; "zb-v", planned by a
list scheduler on the simulator, in :mod:`plait.parallel.pipeline.zb_v`. This module imports both; neither
imports it.
"""

from __future__ import annotations

import difflib
from typing import Callable

from plait.parallel.pipeline.schedules import Schedule, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from plait.parallel.pipeline.zb_v import zb_v

SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
}

# The stage placement (``stage_of``'s ``shape``) each schedule's lists assume; "loop" where not listed.
PLACEMENTS: dict[str, str] = {"zb-v": "v"}


def placement(name: str) -> str:
    """The stage placement schedule ``name``'s lists assume: "v" for "zb-v", else "loop"."""
    return PLACEMENTS.get(name, "loop")


def get_schedule(name: str, p: int, m: int, v: int = 1, costs: dict | None = None) -> Schedule:
    """Build the named schedule's per-rank action lists.

    Args:
        name: one of ``SCHEDULES`` ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v").
        p: pipeline ranks; m: micro-batches per step; v: model chunks per rank (interleaved: any
            ``v >= 2``; zb-v: 2; the others: 1). The lists assume ``placement(name)``.
        costs: per-virtual-stage durations the list scheduler of "zb-v" plans for (see :func:`zb_v`;
            ``plait.parallel.pipeline.simulate.stage_costs`` reads them from a measured step). The other schedules
            are fixed orders and refuse them.

    Raises:
        ValueError: unknown name (the closest known name is suggested), ``v > 1`` for a
            single-chunk schedule, ``v == 1`` for "interleaved", ``v != 2`` for "zb-v", or non-positive
            sizes, ``costs`` for a schedule other than "zb-v"; each message names the numbers and the fix.
            Every schedule takes any ``m >= 1``.
    """
    if name not in SCHEDULES:
        close = difflib.get_close_matches(str(name), list(SCHEDULES), n=1, cutoff=0.0)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown pipeline schedule {name!r}; {hint}known: {sorted(SCHEDULES)}")
    if name == "interleaved" and v == 1:
        raise ValueError(
            f"schedule 'interleaved' needs v >= 2 model chunks per rank, got v={v}; "
            f"set v >= 2 or use schedule '1f1b' for one chunk per rank"
        )
    if costs is not None:
        if name != "zb-v":
            raise ValueError(
                f"schedule {name!r} is a fixed order and takes no costs; only 'zb-v' plans for "
                f"measured stage costs (drop schedule_costs or use schedule 'zb-v')"
            )
        return zb_v(p, m, v, costs)
    return SCHEDULES[name](p, m, v)
