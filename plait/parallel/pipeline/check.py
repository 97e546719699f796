"""Validation of per-rank pipeline action lists (``plait.parallel.pipeline.schedules``): completeness and each
rank's local dependency order; cross-rank deadlock freedom is ``plait.parallel.pipeline.simulate``'s check."""

from __future__ import annotations

from plait.parallel.pipeline.schedules import (
    Action,
    Schedule,
    check_sizes,
    crosses_ranks,
    rank_chunk_of,
    stage_of,
)


def _fail(rank: int, index: int, action: Action, problem: str, fix: str) -> None:
    raise ValueError(f"rank {rank}, action #{index} ({action}): {problem}; {fix}")


def check_schedule(lists: Schedule, p: int, m: int, v: int = 1, shape: str = "loop") -> None:
    """Check per-rank action lists for completeness and local dependency order.

    Checks: one list per rank; every action's micro-batch in ``[0, m)`` and chunk in ``[0, v)``;
    every (micro-batch, virtual stage) has exactly one F and either one B or one BI plus one BW;
    on each rank F comes before that micro-batch/chunk's B or BI, and BI before BW. If comm
    actions are present: RECV_F before its F, SEND_F after it (likewise RECV_B/SEND_B around the
    backward), none on a stage without that peer, and every send has exactly one matching
    receive. Cross-rank deadlock freedom is checked by ``simulate`` (it raises DeadlockError).
    ``shape``: the stage placement the lists assume (``registry.placement(name)``; ``stage_of``).

    Raises:
        ValueError: the first problem, naming the rank, action position, action and fix.
    """
    check_sizes("check_schedule", p, m, v)
    if len(lists) != p:
        raise ValueError(f"schedule has {len(lists)} rank lists but p={p}; give one list per rank")
    last = p * v - 1
    comm = p > 1 and any(not a.is_compute for acts in lists for a in acts if isinstance(a, Action))
    seen, sends, recvs = _scan_actions(lists, p, m, v, last, comm, shape)
    _check_complete(seen, p, m, last, shape)
    if set(sends) != set(recvs):
        missing = sorted(set(sends) ^ set(recvs))[:3]
        raise ValueError(
            f"unmatched sends/receives (direction, micro-batch, receiving stage) "
            f"{missing}; every SEND needs one RECV on the peer stage"
        )


def _scan_actions(
    lists: Schedule, p: int, m: int, v: int, last: int, comm: bool, shape: str
) -> tuple[
    dict[tuple[str, int, int], tuple[int, int]],
    dict[tuple[str, int, int], int],
    dict[tuple[str, int, int], int],
]:
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
                _fail(
                    r,
                    i,
                    a,
                    f"micro-batch must be < m={m} and chunk < v={v}",
                    "fix the index or pass the right m and v",
                )
            s = stage_of(r, a.chunk, p, shape)
            key = (a.kind, a.microbatch, s)
            if key in seen:
                _fail(
                    r,
                    i,
                    a,
                    f"duplicate (first at rank {seen[key][0]} #{seen[key][1]})",
                    "each (micro-batch, stage) runs each kind once",
                )
            seen[key] = (r, i)
            _check_order(r, i, a, s, last, comm and _remote(a, s, p, v, shape), seen)
            if not a.is_compute and not _remote(
                a, s, p, v, shape
            ):  # out-of-range peers failed above
                _fail(
                    r,
                    i,
                    a,
                    "a transfer to a stage on this same rank",
                    "drop it: the executor hands the tensor over directly (use with_communication)",
                )
            if a.kind in ("SEND_F", "SEND_B"):
                sends[(a.kind[-1], a.microbatch, s + (1 if a.kind == "SEND_F" else -1))] = r
            if a.kind in ("RECV_F", "RECV_B"):
                recvs[(a.kind[-1], a.microbatch, s)] = r
    return seen, sends, recvs


PEER_STEP = {"F": -1, "B": 1, "BI": 1, "SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}


def _remote(a: Action, s: int, p: int, v: int, shape: str) -> bool:
    """Whether the stage ``a`` (on stage ``s``) reads from or talks to lives on another rank: stage ``s-1``
    for F, ``s+1`` for B/BI, the peer of a SEND/RECV (``crosses_ranks``). True for BW."""
    return a.kind not in PEER_STEP or crosses_ranks(s, s + PEER_STEP[a.kind], p, v, shape)


def _check_order(
    r: int,
    i: int,
    a: Action,
    s: int,
    last: int,
    comm: bool,
    seen: dict[tuple[str, int, int], tuple[int, int]],
) -> None:
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
        _fail(
            r,
            i,
            a,
            "forward without an earlier RECV_F in a list with communication",
            "insert RECV_F before it (use with_communication)",
        )
    if comm and a.kind in ("B", "BI") and s < last and not has("RECV_B"):
        _fail(
            r,
            i,
            a,
            "backward without an earlier RECV_B in a list with communication",
            "insert RECV_B before it (use with_communication)",
        )


def _check_complete(
    seen: dict[tuple[str, int, int], tuple[int, int]], p: int, m: int, last: int, shape: str
) -> None:
    """Raise unless every (micro-batch, stage) has one F and one B or a BI plus a BW."""
    for mb in range(m):
        for s in range(last + 1):
            r, c = rank_chunk_of(s, p, shape)
            where = f"micro-batch {mb}, stage {s} (rank {r}, chunk {c})"
            if ("F", mb, s) not in seen:
                raise ValueError(f"{where} has no F; add Action('F', {mb}, {c}) to rank {r}")
            split = ("BI", mb, s) in seen or ("BW", mb, s) in seen
            if not split and ("B", mb, s) not in seen:
                raise ValueError(f"{where} has no backward; add Action('B', {mb}, {c}) to rank {r}")
            if split and not (("BI", mb, s) in seen and ("BW", mb, s) in seen):
                raise ValueError(f"{where} has BI without BW or BW without BI; add the missing one")
