"""Schedule "zb-v" and its list scheduler: ZB-V (Qi et al., "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024, Sec. 3) planned greedily in time order for per-virtual-stage costs, and
the best of several such plans by simulated step. :func:`zb_v`'s docstring gives the rules and the bounds.
"""

from __future__ import annotations

import random

from plait.parallel.pipeline.schedules import Action, Schedule, check_sizes, stage_of
from plait.parallel.pipeline.simulate import per_stage_costs, simulate


def zb_v(p: int, m: int, v: int = 2, costs: dict | None = None, tries: int = 16) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024, Sec. 3 and Fig. 4):
    two chunks per rank in the "v" placement (rank ``r`` holds stages ``r`` and ``2p-1-r``), the backward
    split into BI and BW as in :func:`zb_h1`.

    The lists come from a greedy list scheduler run in time order, at most ``2p`` chunk-forwards per rank
    awaiting their BW. On unit costs a step takes ``6m + p - 1`` units for ``m >= 2p`` and p in
    {1, 2, 3, 4, 8} (ZB-H1: ``6m + 2(p-1)``); any ``m >= 1`` works. The scheduler's rules and bounds:
    ``docs/pipeline.md``.

    Args:
        costs: measured or estimated durations per virtual stage, ``{"F": [...], "BI": [...], "BW": [...]}``
            with ``2p`` values each (any unit; e.g. ``stage_costs`` of the executor's timeline), for which
            the scheduler then plans (as the paper's schedules are planned on profiled times, Sec. 4).
            None: unit costs.
        tries: with ``costs``, also plan for ``tries - 1`` copies of ``costs`` jittered by up to 5% (seeded)
            and keep the list whose simulated step (``plait.parallel.pipeline.simulate``) at ``costs`` is
            shortest, the first on ties.

    Raises:
        ValueError: ``v != 2``, or ``costs`` without ``2p`` finite non-negative values for each of F, BI, BW.
    """
    check_sizes("zb-v", p, m, v)
    if v != 2:
        raise ValueError(
            f"schedule 'zb-v' runs v=2 chunks per rank (the V placement), got v={v}; set v=2"
        )
    return plan_zb_v(p, m, costs, tries)


def plan_zb_v(p: int, m: int, costs: dict | None, tries: int) -> Schedule:
    """ZB-V lists for ``p`` ranks and ``m`` micro-batches planned for ``costs`` (unit costs when None): the
    greedy plan for ``costs`` and for ``tries - 1`` seeded copies jittered by up to 5%, the one whose
    simulated step at ``costs`` is shortest (the first on ties). Raises ValueError for bad ``costs``."""
    cost = checked_costs(costs, p)
    if costs is None:
        return _GreedyV(p, m, cost).run()

    def span(lists: Schedule) -> float:
        return simulate(
            lists, p, 2, cost_f=cost["F"], cost_bi=cost["BI"], cost_bw=cost["BW"], shape="v"
        ).makespan

    jitter = [
        random.Random(k) for k in range(1, max(tries, 1))
    ]  # seeded: every rank plans the same
    trials = [cost] + [
        {kind: tuple(x * (1 + 0.05 * rng.uniform(-1, 1)) for x in c) for kind, c in cost.items()}
        for rng in jitter
    ]
    return min((_GreedyV(p, m, trial).run() for trial in trials), key=span)  # the first on ties


def checked_costs(costs: dict | None, p: int) -> dict[str, tuple]:
    """Per-stage F, BI and BW costs for ``p`` ranks in the V placement (unit costs when None)."""
    if costs is None:
        return {k: (1,) * (2 * p) for k in ("F", "BI", "BW")}
    return {
        k: per_stage_costs(k, costs.get(k, ()), p, 2, "v", owner="zb-v") for k in ("F", "BI", "BW")
    }


class _GreedyV:
    """The list scheduler behind :func:`zb_v` (event-driven over the actions' end times)."""

    def __init__(self, p: int, m: int, cost: dict[str, tuple]):
        self.p, self.m, self.last, self.cost = p, m, 2 * p - 1, cost
        self.done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, stage) -> end time
        self.lists: Schedule = [[] for _ in range(p)]
        self.next = {(r, kind, c): 0 for r in range(p) for kind in ("F", "BI") for c in (0, 1)}
        self.weights: list[list[tuple[int, int]]] = [
            [] for _ in range(p)
        ]  # per rank: (mb, chunk) awaiting BW
        self.held = [0] * p  # chunk-forwards whose BW has not run
        self.held_last = [0] * p  # the same, of chunk 1 only

    def _ready(self, key: tuple[str, int, int], t) -> bool:
        return key in self.done and self.done[key] <= t

    def _pick(self, r: int, t) -> Action | None:
        p, m = self.p, self.m
        for c in (0, 1):
            mb, s = self.next[(r, "BI", c)], stage_of(r, c, p, "v")
            if (
                mb < m
                and self._ready(("F", mb, s), t)
                and (s == self.last or self._ready(("BI", mb, s + 1), t))
            ):
                return Action("BI", mb, c)
        for c in (1, 0):
            mb, s = self.next[(r, "F", c)], stage_of(r, c, p, "v")
            if mb < m and self._room(r, c) and (s == 0 or self._ready(("F", mb, s - 1), t)):
                return Action("F", mb, c)
        if self.weights[r]:
            mb, c = self.weights[r][0]
            if self._ready(("BI", mb, stage_of(r, c, p, "v")), t):
                return Action("BW", mb, c)
        return None

    def _room(self, r: int, chunk: int) -> bool:
        """Whether rank r may run another forward of ``chunk``: fewer than ``2p`` held, and chunk 0 takes
        the last place only while a chunk-1 forward is held (whose backward frees a place without this
        rank's help; else, with unequal costs, a rank ahead could fill every place with chunk 0 and stall).
        One rank (p = 1) always prefers its chunk-1 forward, which is ready the moment chunk 0's ends."""
        left = 2 * self.p - self.held[r]
        return left > 1 or (left == 1 and (chunk == 1 or self.held_last[r] > 0 or self.p == 1))

    def _start(self, r: int, a: Action, t):
        """Append ``a`` to rank r's list at time t; returns its end time."""
        s = stage_of(r, a.chunk, self.p, "v")
        end = t + self.cost[a.kind][s]
        self.lists[r].append(a)
        self.done[(a.kind, a.microbatch, s)] = end
        if a.kind in ("F", "BI"):
            self.next[(r, a.kind, a.chunk)] += 1
        held = {"F": 1, "BI": 0, "BW": -1}[a.kind]
        self.held[r] += held
        if a.chunk == 1:
            self.held_last[r] += held
        if a.kind == "BI":
            self.weights[r].append((a.microbatch, a.chunk))
        elif a.kind == "BW":
            self.weights[r].pop(0)
        return end

    def run(self) -> Schedule:
        total, t, free, ends = 6 * self.m, 0, [0] * self.p, set()
        while any(len(acts) < total for acts in self.lists):
            started = True
            while started:  # an action of zero cost ends at t: let every rank look again
                started = False
                for r in range(self.p):
                    while free[r] <= t and (a := self._pick(r, t)) is not None:
                        free[r] = self._start(r, a, t)
                        ends.add(free[r])
                        started = True
            later = [e for e in ends if e > t]
            if not later and any(len(acts) < total for acts in self.lists):
                raise RuntimeError(
                    f"zb-v list scheduler stalled at time {t} (p={self.p}, m={self.m})"
                )
            t = min(later, default=t)
            ends = set(later)
        return self.lists
