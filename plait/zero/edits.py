"""Keep edits made to whole parameters: DeepSpeed's ``GatheredParameters(..., modifier_rank=r)``.

Inside ``ZeroOptimizer.gathered_parameters`` every parameter is whole on every dp rank (stage 3 gathers
it; stages 0-2 hold it whole anyway), so a script may write to it (resize an embedding, re-initialise a
head). The values live in the compute-dtype buffers (``Segment.full``); the optimizer steps the fp32
master shards and copies them back after every step, so an edit that does not reach the masters is lost
at the next step, and under stage 3 it is lost at once when the gathered copy is released. ``adopt_edits``
makes dp rank ``r``'s values everyone's: a broadcast of each segment over dp, then each rank writes the
elements of its own slice that differ from its master weights (rounded to the compute dtype) into the
master shard, so unedited fp32 master weights keep their bits, and, under stage 3, the slice into its
local shard.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch.distributed as dist

OWNER_ATTR = "_plait_zero_owner"  # on each trained parameter: a weak reference to its ZeroOptimizer


def mark_owner(params, opt) -> None:
    """Record ``opt`` as the ZeroOptimizer of ``params`` (DeepSpeed finds a parameter's partitioning the
    same way, from attributes on the parameter), so ``GatheredParameters(params)`` can find it."""
    ref = weakref.ref(opt)
    for p in params:
        setattr(p, OWNER_ATTR, ref)


def owner_of(param):
    """The live ZeroOptimizer that trains ``param``, or None."""
    ref = getattr(param, OWNER_ATTR, None)
    return ref() if ref is not None else None


@contextmanager
def gathered(opt, modifier_rank: int | None = None):
    """Body of ``ZeroOptimizer.gathered_parameters``: every parameter whole (stage 3 gathers) for the
    ``with`` block; at exit ``adopt_edits`` from ``modifier_rank`` (if given), then stage 3 releases.
    Collective over dp."""
    opt.synchronize()
    if opt.gatherer is not None:
        opt.gatherer.gather_all()
    try:
        yield
        if modifier_rank is not None:
            adopt_edits(opt, modifier_rank)
    finally:
        if opt.gatherer is not None:
            opt.gatherer.release_all()


def adopt_edits(opt, modifier_rank: int) -> None:
    """Make dp rank ``modifier_rank``'s whole parameter values the model's on every dp rank, master
    weights included. Call while ``opt``'s parameters are whole (inside ``gathered_parameters``).
    Collective over the dp group.

    Raises:
        ValueError: ``modifier_rank`` is not a dp rank (0 <= r < dp size).
    """
    if not 0 <= modifier_rank < opt.dp_size:
        raise ValueError(
            f"modifier_rank {modifier_rank} is not a data-parallel rank (dp size {opt.dp_size}); "
            f"pass 0 to {opt.dp_size - 1}"
        )
    opt.synchronize()
    for group, master in zip(opt.groups, opt.masters):
        for seg in group.segments:
            if seg.full is None:
                raise RuntimeError(
                    "adopt_edits needs whole parameters: call it inside gathered_parameters()"
                )
            comm = opt.comms.of(
                seg
            )  # expert weights: from the modifier's expert-data-parallel rank
            if comm.size > 1:
                src = dist.get_global_rank(comm.group, comm.source(modifier_rank, opt.dp_size))
                dist.broadcast(seg.full, src=src, group=comm.group)
            own = seg.full[seg.lo : seg.lo + seg.shard_size]
            mine = master.detach()[seg.shard_offset : seg.shard_offset + seg.shard_size]
            edited = own != mine.to(
                own.dtype
            )  # elements the edit changed: the rest keep their fp32 bits
            mine[edited] = own[edited].to(mine.dtype)
            if seg.local is not None and seg.source is None:
                seg.local.copy_(own)
