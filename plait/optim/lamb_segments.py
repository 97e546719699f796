"""LAMB over ZeRO's flat master shards: which elements belong to which logical tensor, and how the
per-tensor squared norms are summed over the ranks that share a tensor (see ``Lamb.set_segments``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from plait.optim.lamb import Lamb
from plait.parallel.sharding import logical_parts, split_flat

if TYPE_CHECKING:
    from plait.parallel.mesh import ParallelMesh
    from plait.zero import ZeroOptimizer


def attach_lamb_segments(
    lamb: Lamb, zero: ZeroOptimizer, module: nn.Module, mesh: ParallelMesh
) -> None:
    """Give ``lamb`` the logical tensor of every piece of ZeRO's flat master shards, and a reduction
    that sums the ``[2, num_tensors]`` float64 per-tensor squared norms over dp (pieces of one tensor on
    several dp ranks, stages 1-3) and over tp (tensor-parallel shards; replicated tensors counted once).

    Args:
        lamb: the torch optimizer ZeRO built over its master shards (``zero.optimizer``).
        zero: the ``ZeroOptimizer`` whose ``groups`` / ``masters`` hold the flat shards.
        module: the model ``zero`` wraps (the logical tensors of its trainable parameters, in order, are
            the tensor indices: a fused parameter's each count as one, as in the unfused model).
        mesh: the ``ParallelMesh`` (dp and tp groups, device).
    """
    parts = {n: logical_parts(n, p) for n, p in module.named_parameters() if p.requires_grad}
    flat = [
        part for ps in parts.values() for part in ps
    ]  # a fused parameter's logical tensors each
    index = {part.name: i for i, part in enumerate(flat)}
    tp_split = torch.tensor(
        [part.spec.tp_split for part in flat], dtype=torch.float64, device=mesh.device
    )
    segments = {
        id(master): [
            (pc.shard_offset + pos, n, index[part.name])
            for pc in group.pieces()
            for part, _, n, pos in split_flat(parts[pc.slot.name], pc.start, pc.length)
        ]
        for group, master in zip(zero.groups, zero.masters)
    }

    def reduce(sq: torch.Tensor) -> torch.Tensor:
        if (
            zero.stage > 0 and zero.dp_size > 1
        ):  # the shards' ranks: dp, or dp x cp under context parallelism
            dist.all_reduce(sq, group=zero.dp_group)
        if mesh.tp > 1:
            split = sq * tp_split
            dist.all_reduce(split, group=mesh.tp_group)
            sq = split + sq * (1 - tp_split)
        return sq

    lamb.set_segments(segments, len(flat), reduce)
