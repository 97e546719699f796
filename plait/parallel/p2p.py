"""Point-to-point transfers between neighbouring pipeline stages with ``batch_isend_irecv``.

A transfer is one tensor moving one hop along the virtual-stage chain: an activation from
stage ``s`` to ``s+1`` (direction "F") or an input gradient from ``s`` to ``s-1`` ("B"). Stage
``s`` lives on pipeline rank ``s % p`` (chunk ``s // p``; see ``plait.parallel.schedules``), whose
global rank is ``mesh.ranks("pp")[s % p]`` for this process's (dp, tp) coordinate, so each tp
rank talks to the same tp rank of the neighbouring stage (its sequence shard under sequence
parallelism, its replica otherwise).

Both sides name a transfer by ``(direction, micro-batch, sending stage)``. Within one batch the
ops are posted in that key's order and each carries a tag derived from it, so the k-th message
between two ranks is the same one on both sides (NCCL matches by order, gloo by tag) whatever
order the schedule listed the actions in. The same code runs on gloo (CPU) and NCCL (GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, order=True)
class Transfer:
    """One hop: ``direction`` "F" (activation, ``src_stage -> src_stage + 1``) or "B" (gradient,
    ``src_stage -> src_stage - 1``) of micro-batch ``microbatch``."""

    direction: str
    microbatch: int
    src_stage: int

    @property
    def dst_stage(self) -> int:
        return self.src_stage + (1 if self.direction == "F" else -1)

    def tag(self, num_stages: int) -> int:
        """A tag unique per transfer within one step: ``2 * (mb * stages + src) + (dir == "B")``."""
        return 2 * (self.microbatch * num_stages + self.src_stage) + (self.direction == "B")


class StageP2P:
    """Sends and receives between this rank's virtual stages and their neighbours.

    Args:
        pp_ranks: global ranks of this process's pipeline group in pp-rank order
            (``mesh.ranks("pp")``); ``pp_ranks[r]`` holds the stages ``r, r + p, r + 2p, ...``.
        group: the pipeline process group (``mesh.pp_group``); None in one process.
        num_stages: ``p * v`` virtual stages.
    """

    def __init__(self, pp_ranks: list[int], group, num_stages: int):
        self.pp_ranks, self.group, self.num_stages = list(pp_ranks), group, num_stages
        self.p = len(self.pp_ranks)

    def peer(self, stage: int) -> int:
        """Global rank holding virtual stage ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"virtual stage {stage} outside [0, {self.num_stages}); "
                             f"p={self.p} ranks x v={self.num_stages // self.p} chunks")
        return self.pp_ranks[stage % self.p]

    def exchange(self, sends: list[tuple[Transfer, torch.Tensor]],
                 recvs: list[tuple[Transfer, torch.Tensor]]) -> None:
        """Post every send and receive as ONE ``batch_isend_irecv`` and wait for all of them.

        Args:
            sends: ``(transfer, tensor)``; the tensor goes to ``transfer.dst_stage``'s rank.
            recvs: ``(transfer, buffer)``; filled in place from ``transfer.src_stage``'s rank.
                The buffer's shape and dtype must equal the sender's tensor's.

        Raises:
            ValueError: a transfer's peer stage lies outside ``[0, p*v)`` (a schedule bug).
        """
        ops = []
        for transfer, tensor in sends:
            ops.append((transfer, dist.P2POp(dist.isend, tensor.contiguous(), self.peer(transfer.dst_stage),
                                             self.group, transfer.tag(self.num_stages))))
        for transfer, buf in recvs:
            if not buf.is_contiguous():
                raise ValueError(f"receive buffer for {transfer} must be contiguous")
            ops.append((transfer, dist.P2POp(dist.irecv, buf, self.peer(transfer.src_stage), self.group,
                                             transfer.tag(self.num_stages))))
        if not ops:
            return
        ops.sort(key=lambda item: item[0])
        for work in dist.batch_isend_irecv([op for _, op in ops]):
            work.wait()
