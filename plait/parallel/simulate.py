"""Time a pipeline schedule without processes: start/end of every action, bubbles, memory, deadlock.

Each rank runs its list in order; an action starts when the rank is free and its inputs exist:

- F of virtual stage ``s > 0`` needs F of ``s-1`` (same micro-batch) done, plus ``cost_comm``
  when the two stages live on different ranks;
- B or BI of ``s < last`` needs B/BI of ``s+1`` done (+ ``cost_comm``); every B/BI needs its own
  F (already done on this rank, else the list is out of order and the run deadlocks);
- BW needs the BI of the same micro-batch and stage.

Lists that contain comm actions (see ``schedules.with_communication``) are run with rendezvous
semantics instead of the ``cost_comm`` latency: each run of consecutive comm actions is one batch
(one ``batch_isend_irecv``) posted when the rank reaches it, and it completes ``cost_comm`` after
every matching op on the peers has been posted too. That is the strictest blocking an executor
can see, so a list that passes here cannot deadlock on batched isend/irecv.

Costs are in any time unit (e.g. the forward time of one whole stage); they may be
``fractions.Fraction`` for exact arithmetic.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from plait.parallel.schedules import Action, Schedule, rank_chunk_of, stage_of


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


def _steps(acts: list[Action]) -> list[Action | list[Action]]:
    """Group consecutive comm actions into one batch (a list); compute actions stay single."""
    steps: list[Action | list[Action]] = []
    for a in acts:
        if a.is_compute:
            steps.append(a)
        elif steps and isinstance(steps[-1], list):
            steps[-1].append(a)
        else:
            steps.append([a])
    return steps


def _link(a: Action, s: int) -> tuple[tuple[str, str, int, int], tuple[str, str, int, int]]:
    """(own key, peer key) of a comm op: (side, direction, micro-batch, sending stage)."""
    if a.kind == "SEND_F":
        link = ("F", a.microbatch, s)
    elif a.kind == "RECV_F":
        link = ("F", a.microbatch, s - 1)
    elif a.kind == "SEND_B":
        link = ("B", a.microbatch, s)
    else:
        link = ("B", a.microbatch, s + 1)
    side, other = ("send", "recv") if a.kind.startswith("SEND") else ("recv", "send")
    return (side, *link), (other, *link)


def simulate(lists: Schedule, p: int, v: int = 1, cost_f: float = 1.0, cost_b: float = 2.0,
             cost_bi: float = 1.0, cost_bw: float = 1.0, cost_comm: float = 0.0) -> SimResult:
    """Run per-rank action lists against the dependency rules above and time every action.

    Args:
        lists: ``lists[r]`` is rank r's ordered actions (compute only, or with comm actions).
        p: pipeline ranks (``len(lists)``); v: model chunks per rank.
        cost_f, cost_b, cost_bi, cost_bw: duration of one F, B, BI, BW of one chunk. For an
            interleaved schedule pass the per-chunk cost (a whole stage's cost divided by v).
        cost_comm: latency of one activation/gradient transfer between different ranks (or of one
            comm batch when comm actions are explicit).

    Returns:
        SimResult with per-action times, bubble and peak-memory figures.

    Raises:
        ValueError: ``len(lists) != p``.
        DeadlockError: no rank can progress; the message lists what each stuck rank waits for.
    """
    if len(lists) != p:
        raise ValueError(f"got {len(lists)} rank lists but p={p}; give one list per rank")
    cost = {"F": cost_f, "B": cost_b, "BI": cost_bi, "BW": cost_bw}
    cost_comm = cost_comm or 0  # a float 0.0 would turn exact Fraction times into floats
    last = p * v - 1
    steps = [_steps(acts) for acts in lists]
    pos = [0] * p
    clock: list[float] = [0] * p
    done: dict[tuple[str, int, int], tuple[float, int]] = {}  # (F|BI|BW, mb, stage) -> (end, rank)
    posted: dict[tuple, float] = {}  # comm op key -> time its batch was posted
    arrived: list[float | None] = [None] * p  # when rank r reached its current comm batch
    timeline: list[list[Timed]] = [[] for _ in range(p)]
    explicit = any(not a.is_compute for acts in lists for a in acts)

    def ready(r: int, a: Action) -> tuple[float | None, str]:
        return _ready(r, a, p, last, clock, done, cost_comm, explicit)

    while True:
        progressed = False
        for r in range(p):
            while pos[r] < len(steps[r]):
                step = steps[r][pos[r]]
                if isinstance(step, Action):
                    start, _ = ready(r, step)
                    if start is None:
                        break
                    _run_compute(r, step, start, start + cost[step.kind], p, done, timeline, clock)
                elif not _run_comm_batch(r, step, p, clock, arrived, posted, cost_comm):
                    break
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(steps[r]) for r in range(p)):
            break
        if not progressed:
            raise DeadlockError(_stuck_message(steps, pos, ready, p))
    return _sim_result(lists, p, v, timeline, clock)


def _ready(r: int, a: Action, p: int, last: int, clock: list[float],
           done: dict[tuple[str, int, int], tuple[float, int]], cost_comm: float,
           explicit: bool) -> tuple[float | None, str]:
    """Earliest start of compute action a on rank r, or None and what it waits for."""
    s = stage_of(r, a.chunk, p)
    need = []
    if a.kind == "F" and s > 0:
        need.append(("F", a.microbatch, s - 1))
    if a.kind in ("B", "BI"):
        need.append(("F", a.microbatch, s))
        if s < last:
            need.append(("BI", a.microbatch, s + 1))
    if a.kind == "BW":
        need.append(("BI", a.microbatch, s))
    t = clock[r]
    for key in need:
        if key not in done:
            return None, f"{key[0]} of micro-batch {key[1]} at stage {key[2]}"
        end, src = done[key]
        t = max(t, end + (cost_comm if src != r and not explicit else 0))
    return t, ""


def _run_compute(r: int, step: Action, start: float, end: float, p: int,
                 done: dict[tuple[str, int, int], tuple[float, int]],
                 timeline: list[list[Timed]], clock: list[float]) -> None:
    """Record compute action step on rank r running from start to end."""
    s = stage_of(r, step.chunk, p)
    for k in (("F",) if step.kind == "F" else ("BI", "BW") if step.kind == "B"
              else (step.kind,)):
        done[(k, step.microbatch, s)] = (end, r)
    timeline[r].append(Timed(step, start, end))
    clock[r] = end


def _run_comm_batch(r: int, batch: list[Action], p: int, clock: list[float],
                    arrived: list[float | None], posted: dict[tuple, float],
                    cost_comm: float) -> bool:
    """Post rank r's comm batch (once); complete it and return True if every peer has posted."""
    if arrived[r] is None:
        arrived[r] = clock[r]
        for a in batch:
            posted[_link(a, stage_of(r, a.chunk, p))[0]] = clock[r]
    peers = [posted.get(_link(a, stage_of(r, a.chunk, p))[1]) for a in batch]
    if any(t is None for t in peers):
        return False
    clock[r] = max([arrived[r], *peers]) + cost_comm
    arrived[r] = None
    return True


def _sim_result(lists: Schedule, p: int, v: int, timeline: list[list[Timed]],
                clock: list[float]) -> SimResult:
    """Summarise a finished run: makespan, busy/idle/bubble per rank and memory peaks."""
    busy = tuple(sum((t.end - t.start for t in tl), start=0) for tl in timeline)
    makespan = max((tl[-1].end for tl in timeline if tl), default=0)
    makespan = max([makespan, *clock])
    idle = tuple(makespan - b for b in busy)
    peaks = [_peaks(acts) for acts in lists]
    return SimResult(
        p=p, v=v, timeline=tuple(tuple(tl) for tl in timeline), makespan=makespan, busy=busy,
        idle=idle, bubble_ratio=tuple(i / b if b else 0 for i, b in zip(idle, busy)),
        peak_in_flight=tuple(pk[0] for pk in peaks), peak_unfinished=tuple(pk[1] for pk in peaks))


def _stuck_message(steps, pos, ready, p: int) -> str:
    lines = []
    for r in range(p):
        if pos[r] == len(steps[r]):
            continue
        step = steps[r][pos[r]]
        if isinstance(step, Action):
            what = f"{step} waits for {ready(r, step)[1]}"
        else:
            what = "comm batch [" + ", ".join(map(str, step)) + "] waits for its peers to post"
        lines.append(f"rank {r} at step #{pos[r]}: {what}")
    return ("pipeline schedule deadlocks: no rank can make progress. " + "; ".join(lines)
            + ". Reorder the lists so each action's inputs are produced earlier "
            "(check_schedule finds local ordering errors)")


def with_communication(lists: Schedule, p: int, v: int = 1) -> Schedule:
    """Return new lists with SEND_*/RECV_* actions placed so batched isend/irecv cannot deadlock.

    Each run of consecutive comm actions in a rank's list is meant to be one
    ``torch.distributed.batch_isend_irecv`` that the executor waits on before its next compute
    action. Placement rule (time-aligned, Megatron pairs sends with receives the same way in its
    lock-step 1F1B): time the compute-only lists with ``simulate``'s default costs; a transfer
    consumed by an action starting at simulated time t gets its RECV immediately before that
    action and its SEND immediately before the sender's first compute action that starts at or
    after t (after the sender's last action if none). Matching ops therefore sit in batches at the
    same simulated time, so even rendezvous semantics (NCCL groups: a batch finishes only when all
    its peers have posted theirs) make progress; ``simulate`` checks that for lists with comm
    actions. Placing each send right after its producer instead deadlocks interleaved 1F1B
    (e.g. p=2, m=4, v=2) under rendezvous semantics.

    Comm actions already in ``lists`` are dropped and placed anew. Stage 0 never receives
    activations and the last stage never receives gradients; with ``p == 1`` every peer is the
    same rank and the compute actions are returned unchanged (copied).

    Raises:
        DeadlockError: the compute-only lists already deadlock.
    """
    compute = [[a for a in acts if a.is_compute] for acts in lists]
    if p == 1:
        return compute
    res = simulate(compute, p, v)
    starts = [[t.start for t in tl] for tl in res.timeline]
    index = {}  # (F|BI, mb, stage) -> position in its rank's list
    for r, acts in enumerate(compute):
        for j, a in enumerate(acts):
            if a.kind in ("F", "B", "BI"):
                index[("F" if a.kind == "F" else "BI", a.microbatch, stage_of(r, a.chunk, p))] = j
    before: list[dict[int, list[Action]]] = [{} for _ in range(p)]
    last = p * v - 1
    for r, acts in enumerate(compute):
        for j, a in enumerate(acts):
            s = stage_of(r, a.chunk, p)
            if a.kind == "F" and s > 0:
                src, recv, send = ("F", a.microbatch, s - 1), "RECV_F", "SEND_F"
            elif a.kind in ("B", "BI") and s < last:
                src, recv, send = ("BI", a.microbatch, s + 1), "RECV_B", "SEND_B"
            else:
                continue
            peer, peer_chunk = rank_chunk_of(src[2], p)
            i = index[src]
            k = bisect.bisect_left(starts[peer], starts[r][j], lo=i + 1)
            before[peer].setdefault(k, []).append(Action(send, a.microbatch, peer_chunk))
            before[r].setdefault(j, []).append(Action(recv, a.microbatch, a.chunk))
    out = []
    for r, acts in enumerate(compute):
        new: list[Action] = []
        for j in range(len(acts) + 1):
            new += sorted(before[r].get(j, []), key=lambda a: (a.kind.startswith("RECV"), a.kind))
            if j < len(acts):
                new.append(acts[j])
        out.append(new)
    return out


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
        return letter[a.kind] + str(a.microbatch) + ("" if result.v == 1 else "abcdefghij"[a.chunk % 10])

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
