"""Pipeline schedules as data: a pure function per schedule returns each rank's ordered actions.

A schedule for ``p`` pipeline ranks, ``m`` micro-batches and ``v`` model chunks per rank is a
``list[list[Action]]``: entry ``r`` is what pipeline rank ``r`` runs, in order. One executor runs
any such list; :func:`plait.parallel.simulate.simulate` times it without processes.

Virtual stages (Megatron-LM's interleaved assignment, Narayanan et al. SC'21, Sec. 2.2): model
chunk ``c`` on rank ``r`` is virtual stage ``s = c*p + r``. Stage 0 (the embedding end) is rank 0
chunk 0; the last stage ``v*p - 1`` (the loss end) is rank ``p-1`` chunk ``v-1``. Activations flow
from stage ``s`` to ``s+1``, gradients from ``s+1`` to ``s``; with ``v = 1`` stage == rank.

Generators emit compute actions only (F, B, BI, BW).
:func:`plait.parallel.simulate.with_communication` inserts the sends and receives; see its
docstring for the placement rule that keeps batched isend/irecv deadlock-free.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

COMPUTE_KINDS = ("F", "B", "BI", "BW")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS

Schedule = list[list["Action"]]


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank.

    Attributes:
        kind: "F" forward; "B" full backward (input and weight gradient); "BI" backward for the
            input gradient only; "BW" the weight-gradient part (needs that micro-batch's BI on the
            same stage); "SEND_F"/"RECV_F" send this stage's output activation to stage ``s+1`` /
            receive this stage's input from ``s-1``; "SEND_B"/"RECV_B" send the input gradient to
            stage ``s-1`` / receive the output gradient from ``s+1``. The peer is implied.
        microbatch: micro-batch index, ``0 <= microbatch < m``.
        chunk: model chunk on this rank, ``0 <= chunk < v``; virtual stage ``chunk*p + rank``.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {KINDS}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(f"Action {self.kind} needs microbatch >= 0 and chunk >= 0, "
                             f"got microbatch={self.microbatch}, chunk={self.chunk}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, p: int) -> int:
    """Virtual stage held by ``chunk`` on pipeline ``rank``: ``chunk*p + rank``."""
    return chunk * p + rank


def rank_chunk_of(stage: int, p: int) -> tuple[int, int]:
    """Inverse of :func:`stage_of`: ``(rank, chunk) = (stage % p, stage // p)``."""
    return stage % p, stage // p


def _check_sizes(name: str, p: int, m: int, v: int) -> None:
    sizes = (("p (pipeline ranks)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v))
    for label, value in sizes:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}")


def _single_chunk(name: str, v: int) -> None:
    if v != 1:
        raise ValueError(f"schedule {name!r} runs one model chunk per rank but got v={v}; use "
                         f"schedule 'interleaved' for v={v} virtual stages per rank, or set v=1")


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al., NeurIPS 2019): every rank runs all m forwards, then all m backwards.

    Backwards run in reverse micro-batch order (the last forward's activations are freshest).
    Bubble ratio (idle / busy) is ``(p-1)/m``; every rank holds activations of all ``m``
    micro-batches at its peak. Any ``m >= 1`` works. Raises ValueError for ``v != 1``.
    """
    _check_sizes("gpipe", p, m, v)
    _single_chunk("gpipe", v)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]
            for _ in range(p)]


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al., ICML 2021 "Memory-Efficient Pipeline-Parallel DNN
    Training", and SC'21 Sec. 2.2.1).

    Rank ``r`` runs ``w = min(p-r-1, m)`` warm-up forwards, then ``m-w`` pairs (forward of the next
    micro-batch, backward of the oldest), then ``w`` cool-down backwards. Peak activations held:
    ``min(p-r, m)`` micro-batches on rank r (vs. m for GPipe); bubble ratio ``(p-1)/m`` as GPipe.
    ``m < p`` is allowed (warm-up is clamped to m; the pipeline is then mostly bubble).
    Raises ValueError for ``v != 1``.
    """
    _check_sizes("1f1b", p, m, v)
    _single_chunk("1f1b", v)
    out = []
    for r in range(p):
        w = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(w)]
        for i in range(m - w):
            acts += [Action("F", w + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - w, m)]
        out.append(acts)
    return out


def _interleaved_order(m: int, p: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(microbatch, chunk) of every forward (or backward) on a rank, in interleaved order; ``m*v`` pairs.

    Micro-batches go in rounds (Megatron-LM's micro-batch groups): ``max(m // p, 1)`` rounds of
    consecutive micro-batches, sizes as equal as possible, larger ones last (each ``>= p`` when
    ``m >= p``; exactly ``p`` when ``m`` is a multiple of ``p``; one round of ``m`` when ``m < p``).
    Within a round: chunk 0 for all its micro-batches, then chunk 1, ... (backward: chunk v-1 first).
    """
    rounds = max(m // p, 1)
    out, start = [], 0
    for j in range(rounds):
        size = m // rounds + (j >= rounds - m % rounds)
        for c in range(v):
            out += [(start + i, v - 1 - c if backward else c) for i in range(size)]
        start += size
    return out


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21 "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", Sec. 2.2.2), for any ``m >= 1``.

    Each rank holds ``v`` model chunks (virtual stage ``c*p + r``). Forwards go in rounds of ``g``
    micro-batches through chunk 0, then chunk 1, ...; backwards in the same rounds through chunk
    ``v-1`` first (:func:`_interleaved_order`: ``g = p`` when p divides m, as in the paper; else
    rounds of ``p <= g < 2p``; ``g = m`` when ``m < p``). Rank ``r`` warms up with
    ``w = min((p-r-1)*2 + (v-1)*G, m*v)`` chunk-forwards, ``G`` the largest round (so the first
    backward of every round finds its forward done), then alternates one chunk-forward with one
    chunk-backward, then cools down. With each chunk costing ``1/v`` of a whole stage, the bubble
    ratio is ``(p-1)/(v*m)`` for ``m >= p`` (Sec. 2.2.2: bubble time ``(p-1)(t_f+t_b)/v``) and
    ``(p-1 + (v-1)(p-m))/(v*m)`` for ``m < p`` (every round trip through the ranks waits for the
    ``p-m`` missing micro-batches; use '1f1b' there). The price is ``v`` times more point-to-point
    messages and more activations held on early ranks (rank r: ``min(w+1, m*v)`` chunks).

    Raises:
        ValueError: non-positive sizes.
    """
    _check_sizes("interleaved", p, m, v)
    total = m * v
    largest = -(-m // max(m // p, 1))
    fwd = [Action("F", mb, c) for mb, c in _interleaved_order(m, p, v, False)]
    bwd = [Action("B", mb, c) for mb, c in _interleaved_order(m, p, v, True)]
    out = []
    for r in range(p):
        w = min((p - r - 1) * 2 + (v - 1) * largest, total)
        acts = fwd[:w]
        for i in range(total - w):
            acts += [fwd[w + i], bwd[i]]
        acts += bwd[total - w:]
        out.append(acts)
    return out


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 2.1 and Fig. 3 top).

    The backward splits into BI (input gradient, on the critical path) and BW (weight gradient,
    movable). Rank ``r`` keeps 1F1B's F/BI order (``min(p-r-1, m)`` warm-up forwards, then
    forward/BI pairs, then cool-down BIs) so activations held stay at 1F1B's ``min(p-r, m)``, and
    delays its weight-gradient passes by ``r`` micro-batches: BW of micro-batch ``i - r`` follows
    BI ``i``, and the last ``min(r, m)`` BWs close the step, filling the tail bubble. Every rank
    then has ``min(p, m)`` micro-batches between forward and BW, the paper's "same number of
    in-flight micro-batches". With T_F = T_BI = T_BW and ``m >= p`` the bubble is ``(p-1)/(3m)``
    of the busy time, a third of 1F1B's ``(p-1)/m`` (``m < p`` runs, with a larger bubble).
    Raises ValueError for ``v != 1``.
    """
    _check_sizes("zb-h1", p, m, v)
    _single_chunk("zb-h1", v)
    out = []
    for r in range(p):
        w = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(w)]
        for i in range(m):  # BI i, preceded by a forward while any are left, followed by BW i-r
            acts += [Action("F", w + i)] if w + i < m else []
            acts += [Action("BI", i)] + ([Action("BW", i - r)] if i >= r else [])
        acts += [Action("BW", i) for i in range(max(m - r, 0), m)]
        out.append(acts)
    return out


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def get_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build the named schedule's per-rank action lists.

    Args:
        name: one of ``SCHEDULES`` ("gpipe", "1f1b", "interleaved", "zb-h1").
        p: pipeline ranks; m: micro-batches per step; v: model chunks per rank (interleaved only).

    Raises:
        ValueError: unknown name (the closest known name is suggested), ``v > 1`` for a
            single-chunk schedule, ``v == 1`` for "interleaved", or non-positive sizes; each message
            names the numbers and the fix. Every schedule takes any ``m >= 1``.
    """
    if name not in SCHEDULES:
        close = difflib.get_close_matches(str(name), list(SCHEDULES), n=1, cutoff=0.0)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown pipeline schedule {name!r}; {hint}known: {sorted(SCHEDULES)}")
    if name == "interleaved" and v == 1:
        raise ValueError(f"schedule 'interleaved' needs v >= 2 model chunks per rank, got v={v}; "
                         f"set v >= 2 or use schedule '1f1b' for one chunk per rank")
    return SCHEDULES[name](p, m, v)


def _fail(rank: int, index: int, action: Action, problem: str, fix: str) -> None:
    raise ValueError(f"rank {rank}, action #{index} ({action}): {problem}; {fix}")


def check_schedule(lists: Schedule, p: int, m: int, v: int = 1) -> None:
    """Check per-rank action lists for completeness and local dependency order.

    Checks: one list per rank; every action's micro-batch in ``[0, m)`` and chunk in ``[0, v)``;
    every (micro-batch, virtual stage) has exactly one F and either one B or one BI plus one BW;
    on each rank F comes before that micro-batch/chunk's B or BI, and BI before BW. If comm
    actions are present: RECV_F before its F, SEND_F after it (likewise RECV_B/SEND_B around the
    backward), none on a stage without that peer, and every send has exactly one matching
    receive. Cross-rank deadlock freedom is checked by ``simulate`` (it raises DeadlockError).

    Raises:
        ValueError: the first problem, naming the rank, action position, action and fix.
    """
    _check_sizes("check_schedule", p, m, v)
    if len(lists) != p:
        raise ValueError(f"schedule has {len(lists)} rank lists but p={p}; give one list per rank")
    last = p * v - 1
    comm = p > 1 and any(not a.is_compute for acts in lists for a in acts if isinstance(a, Action))
    seen, sends, recvs = _scan_actions(lists, p, m, v, last, comm)
    _check_complete(seen, p, m, last)
    if set(sends) != set(recvs):
        missing = sorted(set(sends) ^ set(recvs))[:3]
        raise ValueError(f"unmatched sends/receives (direction, micro-batch, receiving stage) "
                         f"{missing}; every SEND needs one RECV on the peer stage")


def _scan_actions(lists: Schedule, p: int, m: int, v: int, last: int, comm: bool) -> tuple[
        dict[tuple[str, int, int], tuple[int, int]], dict[tuple[str, int, int], int],
        dict[tuple[str, int, int], int]]:
    """Check every action in rank order; return (seen, sends, recvs) for the global checks.

    ``seen`` maps (kind, micro-batch, stage) to (rank, index); ``sends`` and ``recvs`` map
    (direction, micro-batch, receiving stage) to the rank holding the op.
    """
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, mb, stage) -> (rank, index)
    sends: dict[tuple[str, int, int], int] = {}
    recvs: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(lists):
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise ValueError(f"rank {r}, item #{i} is {a!r}, not an Action")
            if a.microbatch >= m or a.chunk >= v:
                _fail(r, i, a, f"micro-batch must be < m={m} and chunk < v={v}",
                      "fix the index or pass the right m and v")
            s = stage_of(r, a.chunk, p)
            key = (a.kind, a.microbatch, s)
            if key in seen:
                _fail(r, i, a, f"duplicate (first at rank {seen[key][0]} #{seen[key][1]})",
                      "each (micro-batch, stage) runs each kind once")
            seen[key] = (r, i)
            _check_order(r, i, a, s, last, comm, seen)
            if a.kind in ("SEND_F", "SEND_B"):
                sends[(a.kind[-1], a.microbatch, s + (1 if a.kind == "SEND_F" else -1))] = r
            if a.kind in ("RECV_F", "RECV_B"):
                recvs[(a.kind[-1], a.microbatch, s)] = r
    return seen, sends, recvs


def _check_order(r: int, i: int, a: Action, s: int, last: int, comm: bool,
                 seen: dict[tuple[str, int, int], tuple[int, int]]) -> None:
    """Raise if action a (#i on rank r, stage s) is out of order with its rank's earlier ones."""
    has = lambda k: (k, a.microbatch, s) in seen  # noqa: E731 - earlier on this rank
    if a.kind in ("B", "BI") and not has("F"):
        _fail(r, i, a, "backward before its forward on this rank", "move the F earlier")
    if a.kind == "B" and (has("BI") or has("BW")):
        _fail(r, i, a, "mixes B with BI/BW for one micro-batch", "use either B or BI+BW")
    if a.kind == "BW" and not has("BI"):
        _fail(r, i, a, "BW before its BI", "put BW after the BI of the same micro-batch")
    if a.kind == "RECV_F" and (s == 0 or has("F")):
        _fail(r, i, a, "RECV_F on stage 0 or after its F", "receive before the forward")
    if a.kind == "SEND_F" and (s == last or not has("F")):
        _fail(r, i, a, "SEND_F on the last stage or before its F", "send after the forward")
    if a.kind == "RECV_B" and (s == last or has("B") or has("BI")):
        _fail(r, i, a, "RECV_B on the last stage or after its backward", "receive before it")
    if a.kind == "SEND_B" and (s == 0 or not (has("B") or has("BI"))):
        _fail(r, i, a, "SEND_B on stage 0 or before its backward", "send after the backward")
    if comm and a.kind == "F" and s > 0 and not has("RECV_F"):
        _fail(r, i, a, "forward without an earlier RECV_F in a list with communication",
              "insert RECV_F before it (use with_communication)")
    if comm and a.kind in ("B", "BI") and s < last and not has("RECV_B"):
        _fail(r, i, a, "backward without an earlier RECV_B in a list with communication",
              "insert RECV_B before it (use with_communication)")


def _check_complete(seen: dict[tuple[str, int, int], tuple[int, int]], p: int, m: int,
                    last: int) -> None:
    """Raise unless every (micro-batch, stage) has one F and one B or a BI plus a BW."""
    for mb in range(m):
        for s in range(last + 1):
            r, c = rank_chunk_of(s, p)
            where = f"micro-batch {mb}, stage {s} (rank {r}, chunk {c})"
            if ("F", mb, s) not in seen:
                raise ValueError(f"{where} has no F; add Action('F', {mb}, {c}) to rank {r}")
            split = ("BI", mb, s) in seen or ("BW", mb, s) in seen
            if not split and ("B", mb, s) not in seen:
                raise ValueError(f"{where} has no backward; add Action('B', {mb}, {c}) to rank {r}")
            if split and not (("BI", mb, s) in seen and ("BW", mb, s) in seen):
                raise ValueError(f"{where} has BI without BW or BW without BI; add the missing one")
