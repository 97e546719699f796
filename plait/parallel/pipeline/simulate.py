"""Time a pipeline schedule without processes: start/end of every action, bubbles, memory, deadlock.

``simulate(lists, p, v, cost_f, cost_b, ...)`` runs each rank's list in order; an action starts when its
rank is free and its inputs exist (F after the previous stage's F, B/BI after the next stage's B/BI,
plus ``cost_comm`` across ranks; BW after its BI). Lists with comm actions run as the executor runs
them (posting never blocks; a message lands after its SEND and RECV and its channel's previous
message); a channel whose receives are not in send order raises ValueError, a stuck list
``DeadlockError``. Returns a ``SimResult``. Costs are in any time unit and may be
``fractions.Fraction``. Rules in detail: ``docs/pipeline.md``.
"""

from __future__ import annotations

import math
import numbers
import statistics
from dataclasses import dataclass

from plait.parallel.pipeline.schedules import Action, Schedule, rank_of, stage_of


class DeadlockError(RuntimeError):
    """No rank can make progress but some actions have not run."""


@dataclass(frozen=True)
class Timed:
    """An action with its start and end time on its rank."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Timing of one pipeline step (one call of ``simulate``).

    Attributes:
        p, v: pipeline ranks and chunks per rank.
        timeline: per rank, its compute actions in run order with start/end times.
        makespan: end of the last action on any rank (all ranks start at time 0).
        busy: per rank, summed compute time.
        idle: per rank, ``makespan - busy`` (the bubble, including comm waits).
        bubble_ratio: per rank, ``idle / busy`` (0 for a rank with no work).
        peak_in_flight: per rank, the most (micro-batch, chunk) activations held at once: forward
            done, input-gradient backward (B or BI) not yet done. A chunk is 1/v of a stage, so
            with v > 1 divide by v for whole-stage units.
        peak_unfinished: per rank, the most (micro-batch, chunk) with forward done but weight
            gradient (B or BW) not yet done; equals peak_in_flight unless BW is deferred.
    """

    p: int
    v: int
    timeline: tuple[tuple[Timed, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_ratio: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_unfinished: tuple[int, ...]


def _peaks(acts: list[Action]) -> tuple[int, int]:
    held = unfinished = peak_held = peak_unfinished = 0
    for a in acts:
        if a.kind == "F":
            held, unfinished = held + 1, unfinished + 1
        held -= a.kind in ("B", "BI")
        unfinished -= a.kind in ("B", "BW")
        peak_held, peak_unfinished = max(peak_held, held), max(peak_unfinished, unfinished)
    return peak_held, peak_unfinished


def _link(a: Action, s: int) -> tuple[str, str, int, int]:
    """(side, direction, micro-batch, sending stage) of a comm action on virtual stage ``s``."""
    if a.kind == "SEND_F":
        return ("send", "F", a.microbatch, s)
    if a.kind == "RECV_F":
        return ("recv", "F", a.microbatch, s - 1)
    if a.kind == "SEND_B":
        return ("send", "B", a.microbatch, s)
    return ("recv", "B", a.microbatch, s + 1)


def _check_channels(lists: Schedule, p: int, shape: str) -> None:
    """Every channel (sending rank -> receiving rank) receives its messages in the order they are sent.

    Raises:
        ValueError: a receiving rank posts a channel's receives in another order than its sender posts
            the sends (NCCL would pair them wrongly), or a send or receive has no counterpart.
    """
    order: dict[tuple[int, int], dict[str, list]] = {}
    for r, acts in enumerate(lists):
        for a in acts:
            if a.is_compute:
                continue
            side, *msg = _link(a, stage_of(r, a.chunk, p, shape))
            src, dst = (
                rank_of(msg[2], p, shape),
                rank_of(msg[2] + (1 if msg[0] == "F" else -1), p, shape),
            )
            order.setdefault((src, dst), {"send": [], "recv": []})[side].append(tuple(msg))
    for (src, dst), sides in order.items():
        if sides["send"] != sides["recv"]:
            raise ValueError(
                f"rank {dst} posts its receives from rank {src} in the order {sides['recv'][:6]}... but "
                f"rank {src} sends {sides['send'][:6]}...: a channel's receives must follow its sends "
                f"(use with_communication)"
            )


def simulate(
    lists: Schedule,
    p: int,
    v: int = 1,
    cost_f: float = 1.0,
    cost_b: float = 2.0,
    cost_bi: float = 1.0,
    cost_bw: float = 1.0,
    cost_comm: float = 0.0,
    shape: str = "loop",
) -> SimResult:
    """Run per-rank action lists against the dependency rules above and time every action.

    Args:
        lists: ``lists[r]`` is rank r's ordered actions (compute only, or with comm actions).
        p: pipeline ranks (``len(lists)``); v: model chunks per rank.
        cost_f, cost_b, cost_bi, cost_bw: duration of one F, B, BI, BW of one chunk; or a sequence of
            p values, one per rank (e.g. measured: the first and last ranks carry the embedding and the
            loss); or of ``p * v`` values, one per virtual stage (a rank's chunks differ, e.g. under the
            "v" placement rank 0 holds the embedding and the loss, and the first stage's BI is empty while
            its BW is a whole backward). For an interleaved schedule pass the per-chunk cost (a whole
            stage's cost divided by v).
        cost_comm: latency of one activation/gradient transfer between different ranks (with explicit
            comm actions: from the later of its SEND and RECV posts, after its channel's previous transfer).
        shape: the stage placement the lists assume (``plait.parallel.pipeline.registry.placement(name)``).

    Returns:
        SimResult with per-action times, bubble and peak-memory figures.

    Raises:
        ValueError: ``len(lists) != p``, a cost sequence of neither p nor ``p * v`` values, a cost that is
            not finite and >= 0, or a channel's receives posted out of its send order.
        DeadlockError: no rank can progress; the message lists what each stuck rank waits for.
    """
    if len(lists) != p:
        raise ValueError(f"got {len(lists)} rank lists but p={p}; give one list per rank")
    cost = {
        k: per_stage_costs(k, c, p, v, shape)
        for k, c in (("F", cost_f), ("B", cost_b), ("BI", cost_bi), ("BW", cost_bw))
    }
    cost_comm = cost_comm or 0  # a float 0.0 would turn exact Fraction times into floats
    explicit = any(not a.is_compute for acts in lists for a in acts)
    if explicit:
        _check_channels(lists, p, shape)
    sim = _Run(p, p * v - 1, cost_comm, explicit, shape)
    pos = [0] * p
    while True:
        progressed = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                if not sim.step(r, lists[r][pos[r]], cost):
                    break
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(lists[r]) for r in range(p)):
            break
        if not progressed:
            raise DeadlockError(_stuck_message(lists, pos, sim, p))
    return _sim_result(lists, p, v, sim.timeline, sim.clock)


def per_stage_costs(
    kind: str, cost, p: int, v: int, shape: str, *, owner: str | None = None
) -> tuple:
    """``cost`` of one action kind as one value per virtual stage (for :func:`simulate` and the ZB-V planner).

    Args:
        cost: one value, ``p`` per-rank values (each rank's chunks alike) or ``p * v`` per-stage values;
            with ``owner`` only the per-stage form.
        owner: the schedule the costs are for (named in the error), e.g. "zb-v".

    Raises:
        ValueError: another number of values, or a value that is not finite and >= 0.
    """
    seq = not isinstance(cost, numbers.Real)  # a tuple, list or array of values
    values = tuple(cost) if seq else (cost,)
    valid = all(math.isfinite(x) and x >= 0 for x in values)
    if owner is not None and not (seq and len(values) == p * v and valid):
        raise ValueError(
            f"{owner} costs[{kind!r}] needs {p * v} finite non-negative values (one per virtual "
            f"stage), got {list(values) if seq else cost!r}"
        )
    if not valid:
        raise ValueError(f"cost of {kind}: {list(values)} has a value that is not finite and >= 0")
    if not seq or len(values) == p:
        return tuple(values[0 if not seq else rank_of(s, p, shape)] for s in range(p * v))
    if len(values) == p * v:
        return values
    raise ValueError(
        f"cost of {kind}: {len(values)} values; give one, one per rank (p={p}) or one per virtual "
        f"stage (p*v={p * v})"
    )


def stage_costs(timelines: list, p: int, v: int, shape: str = "loop") -> dict[str, list[float]]:
    """Median duration of each compute kind per virtual stage, from one measured step of every rank.

    Args:
        timelines: ``timelines[r]`` is pipeline rank r's timed actions (``PipelineExecutor.timeline``:
            ``ActionTime`` or its ``__dict__``; kind, chunk, start, end in seconds), e.g. all-gathered over
            the pipeline group.
        p, v: pipeline ranks and chunks per rank; shape: the placement the timelines ran in.

    Returns:
        ``{kind: [p * v medians]}`` for each kind present (F, B, BI, BW), 0.0 for a stage that ran no such
        action (a planner takes that as free: give every rank's timeline): the ``costs`` of ``zb_v`` /
        ``PipelineParallel(schedule_costs=...)`` and the per-stage costs of :func:`simulate`.

    Raises:
        ValueError: an action of another kind (e.g. a SEND or RECV).
    """
    runs: dict[tuple[str, int], list[float]] = {}
    for r, timeline in enumerate(timelines):
        for t in timeline:
            t = t if isinstance(t, dict) else vars(t)
            if t["kind"] not in ("F", "B", "BI", "BW"):
                raise ValueError(
                    f"rank {r}: action kind {t['kind']!r} is not a compute kind (F, B, BI, BW)"
                )
            runs.setdefault((t["kind"], stage_of(r, t["chunk"], p, shape)), []).append(
                t["end"] - t["start"]
            )
    kinds = sorted({k for k, _ in runs}, key="F B BI BW".split().index)
    return {
        k: [statistics.median(runs[(k, s)]) if (k, s) in runs else 0.0 for s in range(p * v)]
        for k in kinds
    }


class _Run:
    """The state of one simulation: per-rank clocks and timelines, finished work, posted messages."""

    def __init__(self, p: int, last: int, cost_comm, explicit: bool, shape: str):
        self.p, self.last, self.cost_comm, self.explicit, self.shape = (
            p,
            last,
            cost_comm,
            explicit,
            shape,
        )
        self.clock: list = [0] * p
        self.timeline: list[list[Timed]] = [[] for _ in range(p)]
        self.done: dict[
            tuple[str, int, int], tuple[float, int]
        ] = {}  # (F|BI|BW, mb, stage) -> (end, rank)
        self.posted: dict[tuple, float] = {}  # (side, direction, mb, src stage) -> post time
        self.arrived: dict[tuple, float] = {}  # (direction, mb, src stage) -> arrival time
        self.last_arrival: dict[tuple[int, int], float] = {}  # channel -> its latest arrival

    def step(self, r: int, a: Action, cost: dict) -> bool:
        """Run action ``a`` on rank ``r`` if it can start; False when it must wait."""
        if not a.is_compute:  # posting never blocks
            self.posted[_link(a, stage_of(r, a.chunk, self.p, self.shape))] = self.clock[r]
            return True
        start, _ = self.ready(r, a)
        if start is None:
            return False
        s = stage_of(r, a.chunk, self.p, self.shape)
        end = start + cost[a.kind][s]
        for k in ("F",) if a.kind == "F" else ("BI", "BW") if a.kind == "B" else (a.kind,):
            self.done[(k, a.microbatch, s)] = (end, r)
        self.timeline[r].append(Timed(a, start, end))
        self.clock[r] = end
        return True

    def ready(self, r: int, a: Action) -> tuple[float | None, str]:
        """Earliest start of compute action a on rank r, or None and what it waits for."""
        s = stage_of(r, a.chunk, self.p, self.shape)
        need = []
        if a.kind == "F" and s > 0:
            need.append(("F", a.microbatch, s - 1))
        if a.kind in ("B", "BI"):
            need.append(("F", a.microbatch, s))
            if s < self.last:
                need.append(("BI", a.microbatch, s + 1))
        if a.kind == "BW":
            need.append(("BI", a.microbatch, s))
        t = self.clock[r]
        for key in need:
            src = rank_of(key[2], self.p, self.shape)
            if src != r and self.explicit:
                arrival = self._arrival(("F" if key[0] == "F" else "B", key[1], key[2]), r)
                if arrival is None:
                    return (
                        None,
                        f"the {'activation' if key[0] == 'F' else 'gradient'} of micro-batch {key[1]} "
                        f"from stage {key[2]} (its SEND and RECV must both be posted)",
                    )
                t = max(t, arrival)
                continue
            if key not in self.done:
                return None, f"{key[0]} of micro-batch {key[1]} at stage {key[2]}"
            end, src = self.done[key]
            t = max(t, end + (self.cost_comm if src != r else 0))
        return t, ""

    def _arrival(self, msg: tuple[str, int, int], dst: int) -> float | None:
        """When message ``msg`` lands on rank ``dst``: both sides posted, after the channel's previous one
        (a channel runs its transfers in order, ``cost_comm`` each)."""
        if msg in self.arrived:
            return self.arrived[msg]
        sent, got = self.posted.get(("send", *msg)), self.posted.get(("recv", *msg))
        if sent is None or got is None:
            return None
        channel = (rank_of(msg[2], self.p, self.shape), dst)
        t = max(sent, got, self.last_arrival.get(channel, 0)) + self.cost_comm
        self.arrived[msg] = self.last_arrival[channel] = t
        return t


def _sim_result(
    lists: Schedule, p: int, v: int, timeline: list[list[Timed]], clock: list[float]
) -> SimResult:
    """Summarise a finished run: makespan, busy/idle/bubble per rank and memory peaks."""
    busy = tuple(sum((t.end - t.start for t in tl), start=0) for tl in timeline)
    makespan = max((tl[-1].end for tl in timeline if tl), default=0)
    makespan = max([makespan, *clock])
    idle = tuple(makespan - b for b in busy)
    peaks = [_peaks(acts) for acts in lists]
    return SimResult(
        p=p,
        v=v,
        timeline=tuple(tuple(tl) for tl in timeline),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=tuple(i / b if b else 0 for i, b in zip(idle, busy)),
        peak_in_flight=tuple(pk[0] for pk in peaks),
        peak_unfinished=tuple(pk[1] for pk in peaks),
    )


def _stuck_message(lists: Schedule, pos: list[int], sim: _Run, p: int) -> str:
    lines = []
    for r in range(p):
        if pos[r] < len(lists[r]):
            a = lists[r][pos[r]]
            lines.append(f"rank {r} at step #{pos[r]}: {a} waits for {sim.ready(r, a)[1]}")
    return (
        "pipeline schedule deadlocks: no rank can make progress. "
        + "; ".join(lines)
        + ". Reorder the lists so each action's inputs are produced earlier "
        "(check_schedule finds local ordering errors)"
    )


def render(result: SimResult, unit: float | None = None) -> str:
    """ASCII timeline: one row per rank, one cell per ``unit`` of time (default: shortest action).

    Cells read ``F3`` (forward of micro-batch 3), ``B``, ``I`` (BI), ``W`` (BW); a chunk > 0 adds a
    letter (``F3b`` = chunk 1); ``.`` is idle. An action longer than ``unit`` fills several cells.
    """
    acts = [t for tl in result.timeline for t in tl]
    if not acts:
        return ""
    unit = unit or min(t.end - t.start for t in acts if t.end > t.start)
    letter = {"F": "F", "B": "B", "BI": "I", "BW": "W"}

    def label(a: Action) -> str:
        return (
            letter[a.kind]
            + str(a.microbatch)
            + ("" if result.v == 1 else "abcdefghij"[a.chunk % 10])
        )

    width = max(len(label(t.action)) for t in acts) + 1
    cells = round(result.makespan / unit)
    rows = []
    for r, tl in enumerate(result.timeline):
        row = ["." * (width - 1) + " "] * cells
        for t in tl:
            for c in range(round(t.start / unit), round(t.end / unit)):
                row[c] = label(t.action).ljust(width)
        rows.append(f"rank {r}: " + "".join(row).rstrip())
    return "\n".join(rows)
