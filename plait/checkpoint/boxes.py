"""N-d boxes of a logical tensor: bounds checks, intersection, exact-tiling check, flat ranges.

A *box* is ``(offsets, lengths)``: two tuples of ints, one entry per dim of the logical
tensor, selecting ``tensor[o0:o0+l0, o1:o1+l1, ...]``. A 0-d tensor has the single box
``((), ())``. Every stored slice of a checkpoint tensor is a box; the slices of one tensor
must tile it exactly (cover every element once), which ``check_tiling`` enforces at save
and at load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from plait.checkpoint.errors import CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]


def volume(lengths: Sequence[int]) -> int:
    """Number of elements in a box of ``lengths`` (1 for a 0-d box)."""
    return math.prod(lengths)


def box_error(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> str | None:
    """Why ``(offsets, lengths)`` is not a valid box of a tensor of ``shape``; None when it is."""
    if len(offsets) != len(shape) or len(lengths) != len(shape):
        return (
            f"offsets {list(offsets)} and lengths {list(lengths)} must both have one entry per "
            f"dim of the global shape {list(shape)}"
        )
    for d, (o, n, size) in enumerate(zip(offsets, lengths, shape)):
        if not (isinstance(o, int) and isinstance(n, int)) or o < 0 or n < 0 or o + n > size:
            return (
                f"dim {d}: offset {o} + length {n} is outside [0, {size}] "
                f"(global shape {list(shape)}, offsets {list(offsets)}, lengths {list(lengths)})"
            )
    return None


def intersect(a: Box, b: Box) -> Box | None:
    """The box common to ``a`` and ``b`` (in global coordinates), or None if they share no element."""
    offsets, lengths = [], []
    for oa, la, ob, lb in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(oa, ob), min(oa + la, ob + lb)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return tuple(offsets), tuple(lengths)


def check_tiling(
    name: str, shape: Sequence[int], boxes: Sequence[Box], describe=lambda i: f"slice {i}"
) -> None:
    """Raise ``CheckpointError`` unless ``boxes`` cover every element of ``shape`` exactly once.

    Each box must already be in bounds (see ``box_error``). Empty boxes are ignored.
    ``describe(i)`` names box ``i`` in the message (e.g. its file and key). Cost: a sort plus
    comparisons between boxes whose dim-0 ranges overlap (linear for the usual grid layouts).
    """
    total = volume(shape)
    live = [i for i, (_, lengths) in enumerate(boxes) if volume(lengths) > 0]
    covered = sum(volume(boxes[i][1]) for i in live)
    if not shape:  # 0-d: exactly one non-empty box
        if len(live) != 1:
            raise CheckpointError(
                f"tensor {name!r} (0-d) is stored {len(live)} times; expected once"
            )
        return
    if len(live) > 1:
        lo = np.array([boxes[i][0] for i in live], dtype=np.int64)
        hi = lo + np.array([boxes[i][1] for i in live], dtype=np.int64)
        order = np.argsort(lo[:, 0], kind="stable")
        lo, hi = lo[order], hi[order]
        for k in range(len(live) - 1):
            stop = int(np.searchsorted(lo[:, 0], hi[k, 0], side="left"))
            if stop <= k + 1:
                continue
            hit = np.all((lo[k + 1 : stop] < hi[k]) & (lo[k] < hi[k + 1 : stop]), axis=1)
            if hit.any():
                a, b = live[order[k]], live[order[k + 1 + int(np.argmax(hit))]]
                raise CheckpointError(
                    f"tensor {name!r} shape {list(shape)}: {describe(a)} (offsets {list(boxes[a][0])}, "
                    f"lengths {list(boxes[a][1])}) overlaps {describe(b)} (offsets {list(boxes[b][0])}, "
                    f"lengths {list(boxes[b][1])}); a replicated tensor must be saved by one rank only"
                )
    if covered != total:
        raise CheckpointError(
            f"tensor {name!r} shape {list(shape)}: its {len(live)} slices cover "
            f"{covered} of {total} elements ({total - covered} missing)"
        )


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Boxes covering elements ``[start, stop)`` of a tensor of ``shape`` flattened row-major.

    At most ``2 * ndim - 1`` boxes, in flat order. This is how a ZeRO partition (a range of a
    flattened parameter) is stored as boxes of the logical tensor.

    Raises:
        ValueError: ``0 <= start <= stop <= numel`` does not hold.
    """
    shape = tuple(int(s) for s in shape)
    numel = volume(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(
            f"flat range [{start}, {stop}) is outside [0, {numel}] for shape {list(shape)}"
        )
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    inner = volume(shape[1:])
    rest = (0,) * (len(shape) - 1)
    out: list[Box] = []
    if start % inner:  # partial first row
        row = start // inner
        end = min(stop, (row + 1) * inner)
        out += [
            ((row,) + o, (1,) + n)
            for o, n in flat_range_boxes(shape[1:], start - row * inner, end - row * inner)
        ]
        start = end
    if start < stop and stop // inner > start // inner:  # whole rows
        first, last = start // inner, stop // inner
        out.append(((first,) + rest, (last - first,) + shape[1:]))
        start = last * inner
    if start < stop:  # partial last row
        row = start // inner
        out += [
            ((row,) + o, (1,) + n) for o, n in flat_range_boxes(shape[1:], 0, stop - row * inner)
        ]
    return out
