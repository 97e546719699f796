"""Pipeline schedules as data: a pure function per schedule returns each rank's ordered actions.

A schedule for ``p`` pipeline ranks, ``m`` micro-batches and ``v`` chunks per rank is a
``list[list[Action]]`` (entry ``r``: what rank ``r`` runs, in order): ``gpipe``, ``one_f_one_b``,
``interleaved_1f1b``, ``zb_h1`` (ZB-V: ``plait.parallel.pipeline.zb_v``). There are ``p*v`` virtual
stages; the *placement* (``stage_of``, ``rank_of``) is "loop" (Narayanan et al., SC'21, Sec. 2.2: chunk
``c`` on rank ``r`` is stage ``c*p + r``) or "v" (Qi et al., NeurIPS 2024, Sec. 3: down the ranks and
back up, used by "zb-v"). Generators emit compute actions only (F, B, BI, BW);
``plait.parallel.pipeline.comm_actions.with_communication`` adds sends and receives. Placements in
detail: ``docs/pipeline.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        chunk: model chunk on this rank, ``0 <= chunk < v``; virtual stage ``stage_of(rank, chunk, p, shape)``.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {KINDS}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(
                f"Action {self.kind} needs microbatch >= 0 and chunk >= 0, "
                f"got microbatch={self.microbatch}, chunk={self.chunk}"
            )

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


SHAPES = ("loop", "v")


def _check_shape(shape: str) -> None:
    if shape not in SHAPES:
        raise ValueError(f"unknown stage placement {shape!r}; use one of {SHAPES}")


def stage_of(rank: int, chunk: int, p: int, shape: str = "loop") -> int:
    """Virtual stage held by ``chunk`` on pipeline ``rank`` under placement ``shape`` (module docstring):
    ``chunk*p + rank``, or ``chunk*p + p-1-rank`` for an odd chunk of the "v" placement."""
    _check_shape(shape)
    return chunk * p + (p - 1 - rank if shape == "v" and chunk % 2 else rank)


def rank_chunk_of(stage: int, p: int, shape: str = "loop") -> tuple[int, int]:
    """Inverse of :func:`stage_of`: ``(rank, chunk)`` holding virtual ``stage``."""
    _check_shape(shape)
    chunk, offset = divmod(stage, p)
    return (p - 1 - offset if shape == "v" and chunk % 2 else offset), chunk


def rank_of(stage: int, p: int, shape: str = "loop") -> int:
    """Pipeline rank holding virtual ``stage``: ``rank_chunk_of(stage, p, shape)[0]``."""
    return rank_chunk_of(stage, p, shape)[0]


def crosses_ranks(stage: int, other: int, p: int, v: int, shape: str = "loop") -> bool:
    """Whether virtual stage ``other`` exists (``0 <= other < p*v``) and lives on another rank than ``stage``:
    a tensor between them travels as a SEND/RECV pair; neighbours on one rank hand it over directly."""
    return 0 <= other < p * v and rank_of(other, p, shape) != rank_of(stage, p, shape)


def check_sizes(name: str, p: int, m: int, v: int) -> None:
    sizes = (("p (pipeline ranks)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v))
    for label, value in sizes:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}")


def _single_chunk(name: str, v: int) -> None:
    if v != 1:
        raise ValueError(
            f"schedule {name!r} runs one model chunk per rank but got v={v}; use "
            f"schedule 'interleaved' for v={v} virtual stages per rank, or set v=1"
        )


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al., NeurIPS 2019): every rank runs all m forwards, then all m backwards.

    Backwards run in reverse micro-batch order (the last forward's activations are freshest).
    Bubble ratio (idle / busy) is ``(p-1)/m``; every rank holds activations of all ``m``
    micro-batches at its peak. Any ``m >= 1`` works. Raises ValueError for ``v != 1``.
    """
    check_sizes("gpipe", p, m, v)
    _single_chunk("gpipe", v)
    return [
        [Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]
        for _ in range(p)
    ]


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al., ICML 2021 "Memory-Efficient Pipeline-Parallel DNN
    Training", and SC'21 Sec. 2.2.1).

    Rank ``r`` runs ``w = min(p-r-1, m)`` warm-up forwards, then ``m-w`` pairs (forward of the next
    micro-batch, backward of the oldest), then ``w`` cool-down backwards. Peak activations held:
    ``min(p-r, m)`` micro-batches on rank r (vs. m for GPipe); bubble ratio ``(p-1)/m`` as GPipe.
    ``m < p`` is allowed (warm-up is clamped to m; the pipeline is then mostly bubble).
    Raises ValueError for ``v != 1``.
    """
    check_sizes("1f1b", p, m, v)
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
    check_sizes("interleaved", p, m, v)
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
        acts += bwd[total - w :]
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
    check_sizes("zb-h1", p, m, v)
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
