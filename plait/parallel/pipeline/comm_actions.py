"""The send and receive actions of a schedule: compute lists in, lists with SEND_*/RECV_* out (what the
executor posts as non-blocking transfers, ``plait.parallel.pipeline.p2p``).
"""

from __future__ import annotations

from plait.parallel.pipeline.schedules import Action, Schedule, crosses_ranks, rank_of, stage_of
from plait.parallel.pipeline.simulate import simulate


def with_communication(
    lists: Schedule, p: int, v: int = 1, lookahead: int = 0, shape: str = "loop"
) -> Schedule:
    """Return new lists with SEND_*/RECV_* actions for the executor's non-blocking transfers.

    Placement (``plait.parallel.pipeline.p2p``: sends never block, a receive blocks only the action reading it):

    - each SEND right after the compute action producing its tensor (posted as early as possible);
    - each RECV ``lookahead`` compute actions before the action reading it, moved earlier where needed so
      that every channel (sending rank -> receiving rank) posts its receives in the order its sends are
      posted: NCCL pairs a channel's operations in posting order. ``simulate`` checks both rules for
      lists with comm actions. Default 0 (right before its reader): the sender has usually posted by then,
      so the transfer itself is short, while a receive posted earlier keeps an NCCL kernel spinning on
      the GPU's SMs beside the compute before it (``benchmarks/results/pipeline_2xH100.md`` compares both).
      ``lookahead > 0`` assumes lazily connected NCCL pairs (``plait.parallel.pipeline.p2p``).

    Comm actions already in ``lists`` are dropped and placed anew. Stage 0 never receives activations and
    the last stage never receives gradients; a hop between two stages of one rank (every hop when
    ``p == 1``; stage ``p-1`` to ``p`` in the "v" placement, ``shape``) is a hand-over without comm actions.

    Raises:
        DeadlockError: the compute-only lists already deadlock.
    """
    compute = [[a for a in acts if a.is_compute] for acts in lists]
    if p == 1:
        return compute
    simulate(compute, p, v, shape=shape)
    sent_at, after = _sends(compute, p, v, shape)
    before = _receives(compute, sent_at, p, v, shape, lookahead)
    out = []
    for r, acts in enumerate(compute):
        new: list[Action] = []
        for j, a in enumerate(acts):
            new += [recv for _, recv in sorted(before[r].get(j, []), key=lambda item: item[0])]
            new.append(a)
            new += [after[r][j]] if j in after[r] else []
        out.append(new)
    return out


def _sends(compute: Schedule, p: int, v: int, shape: str):
    """Per rank, the SEND after each compute action whose output crosses to another rank (``after[r][j]``),
    and the index of each message's producer on its sender (``sent_at[(direction, microbatch, stage)]``)."""
    sent_at: dict[tuple[str, int, int], int] = {}  # message -> index of its producer on the sender
    after: list[dict[int, Action]] = [{} for _ in range(p)]
    for r, acts in enumerate(compute):
        for j, a in enumerate(acts):
            s = stage_of(r, a.chunk, p, shape)
            if a.kind in ("F", "B", "BI") and crosses_ranks(
                s, s + (1 if a.kind == "F" else -1), p, v, shape
            ):
                direction = "F" if a.kind == "F" else "B"
                sent_at[(direction, a.microbatch, s)] = j
                after[r][j] = Action("SEND_" + direction, a.microbatch, a.chunk)
    return sent_at, after


def _receives(compute: Schedule, sent_at: dict, p: int, v: int, shape: str, lookahead: int):
    """Per rank, the RECVs to post before compute action ``j`` (``before[r][j]``: ``(k, RECV)``, ``k`` the
    receive's place in its channel's send order): ``lookahead`` actions before the reader, earlier where
    the channel's posting order needs it."""
    reads: dict[tuple[int, int], list] = {}  # channel -> [(send index, reader index, RECV)]
    for r, acts in enumerate(compute):
        for j, a in enumerate(acts):
            s = stage_of(r, a.chunk, p, shape)
            if a.kind in ("F", "B", "BI") and crosses_ranks(
                s, s + (-1 if a.kind == "F" else 1), p, v, shape
            ):
                msg = ("F", a.microbatch, s - 1) if a.kind == "F" else ("B", a.microbatch, s + 1)
                reads.setdefault((rank_of(msg[2], p, shape), r), []).append(
                    (sent_at[msg], j, Action("RECV_" + msg[0], a.microbatch, a.chunk))
                )
    before: list[dict[int, list]] = [{} for _ in range(p)]
    for (_, r), items in sorted(reads.items()):
        post = len(compute[r])
        for k, (_, j, recv) in reversed(list(enumerate(sorted(items)))):
            post = min(post, max(j - lookahead, 0))
            before[r].setdefault(post, []).append((k, recv))
    return before
