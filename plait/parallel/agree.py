"""Ranks that must agree: refuse a run whose processes were started with different settings.

``agree(facts, ...)`` is collective over a process group. Each rank passes a flat dict of facts (a config
flattened to ``"optimizer.params.lr": 0.001`` keys, a model's sizes, its parameter shapes); the ranks
all-gather one short digest each, and only when two digests differ do they gather the dicts themselves to
name the keys. Every rank then raises the same error, naming each key, its values and the ranks holding
them::

    ranks disagree on optimizer.params.lr (0.001 on ranks 0,2; 0.0003 on rank 1); <fix>

Facts that must agree only among some ranks (the parameters a pipeline stage holds are the same on its
data-parallel replicas, not on the other stages) are passed as ``scoped`` facts with a ``scope`` label:
they are compared among the ranks that pass the same label.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import torch.distributed as dist

SHOWN_KEYS = 4  # keys named in the message; the rest are counted


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": [1, 2]}`` (lists stay values; an empty dict
    stays a value, so that a section present on one rank only is still a key)."""
    if not isinstance(tree, Mapping) or not tree:
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def digest(facts: Mapping[str, Any]) -> str:
    """A short stable digest of a flat dict (sha256 of its sorted JSON; non-JSON values by ``str``)."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def agree(
    facts: Mapping[str, Any],
    fix: str,
    group=None,
    scoped: Mapping[str, Any] | None = None,
    scope: Any = None,
    error: type[Exception] = ValueError,
) -> None:
    """Collective over ``group`` (default: the world): return when every rank holds the same ``facts``, and
    the same ``scoped`` facts as every rank with the same ``scope``; else raise ``error`` on every rank
    with one message naming up to four keys (values, ranks; a missing key is "unset") and ending in ``fix``.
    One all-gather of a 32-character digest when they agree; a no-op without a process group.

    Args:
        facts / scoped: flat dicts of JSON-able values (``flatten``). scope: a hashable label, the same
            on the ranks whose ``scoped`` facts must be equal (e.g. the ranks of one data-parallel group).
        fix: the end of the message: what to change. error: the exception class raised.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    scoped = dict(scoped or {})
    mine = (repr(scope), digest(facts), digest(scoped))
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, mine, group=group)
    per_scope: dict[str, set] = {}
    for label, _, scoped_digest in seen:
        per_scope.setdefault(label, set()).add(scoped_digest)
    if len({s[1] for s in seen}) == 1 and all(len(d) == 1 for d in per_scope.values()):
        return
    tables: list = [None] * len(seen)
    dist.all_gather_object(tables, (repr(scope), dict(facts), scoped), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(seen)))
    lines = differences([t[1] for t in tables], ranks)
    for label in dict.fromkeys(t[0] for t in tables):
        members = [i for i, t in enumerate(tables) if t[0] == label]
        lines += differences([tables[i][2] for i in members], [ranks[i] for i in members])
    more = f" (and {len(lines) - SHOWN_KEYS} more keys)" if len(lines) > SHOWN_KEYS else ""
    raise error("ranks disagree on " + " and on ".join(lines[:SHOWN_KEYS]) + more + f"; {fix}")


def differences(tables: list[Mapping[str, Any]], ranks: list[int]) -> list[str]:
    """One line per key whose value differs between ``tables`` (one per rank, in ``ranks`` order):
    ``"key (v1 on ranks 0,2; v2 on rank 1)"``, keys sorted."""
    lines = []
    for key in sorted(set().union(*tables)):
        holders: dict[str, list[int]] = {}
        for rank, table in zip(ranks, tables):
            holders.setdefault(shown(table[key]) if key in table else "unset", []).append(rank)
        if len(holders) > 1:
            parts = [
                f"{value} on {'rank' if len(r) == 1 else 'ranks'} {rank_list(r)}"
                for value, r in holders.items()
            ]
            lines.append(f"{key} (" + "; ".join(parts) + ")")
    return lines


def shown(value: Any, limit: int = 60) -> str:
    """A value as a short text (JSON; cut at ``limit`` characters)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rank_list(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7,8"`` (runs of three or more as ranges)."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(
        f"{a}-{b}" if b - a >= 2 else ",".join(map(str, range(a, b + 1))) for a, b in runs
    )
