"""What ZeRO-3 needs from a scheme that all-gathers some parameters in a narrower dtype than they are kept in
(float8 weights for float8 matmuls: ``plait.precision.float8_gather``; torchao's float8 all-gather for FSDP2).

``ParamGatherer`` (``plait.zero.stage3``) asks ``narrow`` for the bytes to send in place of the compute-dtype
shards of such segments, all-gathers them into a ``[padded]`` uint8 buffer, and hands it to ``landed``;
``released`` comes before the buffer's storage is freed. Only the gathers of the forward and backward hooks
(and their prefetches) go narrow, and only over more than one rank: whole-model access
(``gathered_parameters``: checkpoints, exports, edits) gathers the compute dtype. Parameters, master weights,
gradients and checkpoints keep their dtypes.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from plait.zero.flat import Segment


class GatherCast(Protocol):
    """A narrower all-gather for some stage-3 parameters (see the module docstring)."""

    def casts(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is gathered narrow; the layout gives such parameters flat groups of their own
        (``GroupKey.cast``), so a segment holds only parameters gathered narrow, or none."""
        ...

    def narrow(self, segs: list[Segment], shards: list[torch.Tensor], group) -> list[torch.Tensor]:
        """The ``[S]`` uint8 tensors to all-gather for ``segs`` (``GroupKey.cast``), made from this rank's
        compute-dtype shards ``shards`` (``[S]`` each). Collective over ``group`` (the segments' ranks)."""
        ...

    def landed(self, seg: Segment, full: torch.Tensor) -> None:
        """``full`` (``[padded]`` uint8) holds ``seg`` gathered: set ``seg.full`` and make its parameters
        usable by the layers that read them."""
        ...

    def released(self, seg: Segment) -> None:
        """``seg``'s narrow gather is about to be freed: forget what ``landed`` made of it."""
        ...


def narrows(cast: GatherCast | None, segs: list[Segment], world: int) -> list[bool]:
    """Which of ``segs`` a gather over ``world`` ranks sends narrow: with a ``cast``, over more than one rank,
    the segments of ``GroupKey.cast``."""
    return [cast is not None and world > 1 and s.key.cast for s in segs]


def sources(
    cast: GatherCast | None,
    segs: list[Segment],
    shards: list[torch.Tensor],
    flags: list[bool],
    group,
) -> list[torch.Tensor]:
    """What to all-gather for each of ``segs``: its shard, or for those ``flags`` marks (``narrows``) what
    ``cast.narrow`` makes of it (one call for them all). Collective over ``group`` when one is marked."""
    picked = [k for k, f in enumerate(flags) if f]
    if not picked:
        return shards
    out = list(shards)
    made = cast.narrow([segs[k] for k in picked], [shards[k] for k in picked], group)
    for k, x in zip(picked, made):
        out[k] = x
    return out


def land(cast: GatherCast | None, seg: Segment, full: torch.Tensor) -> None:
    """The gather of ``seg`` into ``full`` is complete: its parameters become views of ``full`` (the compute
    dtype), or what ``cast.landed`` makes of a narrow ``full``."""
    if full.dtype == seg.local.dtype:
        seg.set_views(full)
    else:
        cast.landed(seg, full)


def forget(cast: GatherCast | None, seg: Segment) -> None:
    """Before ``seg`` is released: ``cast.released`` if it is gathered narrow."""
    if seg.full is not None and seg.full.dtype != seg.local.dtype:
        cast.released(seg)
