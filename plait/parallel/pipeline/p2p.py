"""Point-to-point transfers between neighbouring pipeline stages: posted ahead, waited on only by their use.

A ``Transfer`` is one tensor moving one hop along the virtual-stage chain (an activation "F" from stage
``s`` to ``s+1``, an input gradient "B" from ``s`` to ``s-1``); ``StageP2P`` posts each as its own
non-blocking ``isend``/``irecv`` to the same (dp, cp, tp) coordinate of the neighbouring stage.
Messages from a lower to a higher pipeline rank travel on the "up" group, the others on "down"
(``channel_groups``), so each (group, pair) carries one direction and a channel's receives posted in its
send order cannot deadlock under NCCL (with groups connected lazily: no ``device_id``).

``TPSlices`` (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21, Sec. 4.1): with tp > 1 and no sequence parallelism each tp rank sends only its
``1/tp`` part and the receiver all-gathers the whole tensor over its tp group. Channels and NCCL's
ordering in detail: ``docs/pipeline.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.parallel.collectives import all_gather_flat
from plait.parallel.pipeline.schedules import rank_of


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


def channel_groups(mesh) -> tuple:
    """The ("up", "down") process groups of this rank's pipeline column (collective over the world).

    Every rank must call this in the same order (``ParallelMesh.new_column_group``, twice). Returns
    ``(None, None)`` without a mesh or with ``pp == 1``.
    """
    if mesh is None or mesh.pp == 1:
        return None, None
    return mesh.new_column_group(), mesh.new_column_group()


class StageP2P:
    """Sends and receives between this rank's virtual stages and their neighbours.

    Args:
        pp_ranks: global ranks of this process's pipeline group in pp-rank order
            (``mesh.ranks("pp")``); ``pp_ranks[r]`` holds the stages of pipeline rank ``r``.
        groups: ``(up, down)`` from :func:`channel_groups` (``(None, None)`` in one process).
        num_stages: ``p * v`` virtual stages.
        pp_rank: this process's pipeline rank.
        shape: the stage placement (``plait.parallel.pipeline.schedules.stage_of``): "loop" or "v".
    """

    def __init__(
        self,
        pp_ranks: list[int],
        groups: tuple,
        num_stages: int,
        pp_rank: int = 0,
        shape: str = "loop",
    ):
        self.pp_ranks, self.groups, self.num_stages = list(pp_ranks), groups, num_stages
        self.p, self.pp_rank, self.shape = len(self.pp_ranks), pp_rank, shape

    def peer_rank(self, stage: int) -> int:
        """Pipeline rank holding virtual stage ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(
                f"virtual stage {stage} outside [0, {self.num_stages}); "
                f"p={self.p} ranks x v={self.num_stages // self.p} chunks"
            )
        return rank_of(stage, self.p, self.shape)

    def _op(self, fn, tensor: torch.Tensor, src: int, dst: int, transfer: Transfer):
        group = self.groups[0] if src < dst else self.groups[1]
        peer = self.pp_ranks[dst if fn is dist.isend else src]
        return fn(tensor, peer, group, transfer.tag(self.num_stages))

    def send(self, transfer: Transfer, tensor: torch.Tensor):
        """Post ``tensor`` (a contiguous copy when it is not contiguous, held by the work) to
        ``transfer.dst_stage``'s rank; returns the work: do not modify ``tensor`` until it completes. Raises
        ValueError for a peer stage outside ``[0, p*v)``."""
        return self._op(
            dist.isend,
            tensor.contiguous(),
            self.pp_rank,
            self.peer_rank(transfer.dst_stage),
            transfer,
        )

    def recv(self, transfer: Transfer, buf: torch.Tensor):
        """Post a receive into the contiguous ``buf`` (shape and dtype of the sender's tensor) from
        ``transfer.src_stage``'s rank; returns the work to wait on before reading ``buf``."""
        if not buf.is_contiguous():
            raise ValueError(f"receive buffer for {transfer} must be contiguous")
        return self._op(dist.irecv, buf, self.peer_rank(transfer.src_stage), self.pp_rank, transfer)

    def connect(self, device: torch.device) -> None:
        """Create every channel's connection up front: one single (not batched) one-element send per
        (channel, neighbouring pair), walked in one order on every rank. NCCL connects a pair's point-to-point
        operations of a group at their first single ``isend``/``irecv`` (batched ones use the group's own
        communicator), blocking the host until the peer arrives too; in the middle of a step, with receives
        posted ahead, two ranks could each wait there for the other. Collective over the pipeline column."""
        if self.p == 1:
            return
        p, me = self.p, self.pp_rank
        wraps = (
            self.num_stages > p and p > 2 and self.shape == "loop"
        )  # loop: stage p-1 -> p is rank p-1 -> 0
        pairs = [(a, a + 1) for a in range(p - 1)] + ([(0, p - 1)] if wraps else [])
        works, keep = [], []
        for up, group in ((True, self.groups[0]), (False, self.groups[1])):
            for a, b in pairs:
                src, dst = (a, b) if up else (b, a)
                if me in (src, dst):
                    buf = torch.zeros(1, device=device)
                    fn = dist.isend if me == src else dist.irecv
                    works.append(fn(buf, self.pp_ranks[dst if me == src else src], group))
                    keep.append(buf)
        for work in works:
            work.wait()


class TPSlices:
    """The ``1/tp`` parts of a tensor that every tp rank of a stage holds whole (see the module docstring).

    Rule: the tensor of ``n`` elements is flattened, zero-padded to ``tp * k`` elements with
    ``k = ceil(n / tp)`` (no padding, and no copy, when tp divides n, as for plait's ``[b, s, h]`` with h
    divisible by tp), and cut into tp contiguous parts of ``k`` elements; tp rank ``r`` sends part ``r``
    (elements ``r*k .. r*k + k - 1``) to the same tp rank of the neighbouring stage. The receiver posts a
    receive of ``k`` elements and, once it has landed, :meth:`gather` all-gathers the tp parts over the tp
    group in tp-rank order and drops the padding, giving back the sender's tensor bitwise.

    Only valid when the tensor is identical on all tp ranks of the sending stage (activations and input
    gradients of tensor-parallel layers without sequence parallelism: copy-to-tp all-reduces the input
    gradient, dropout draws from the replicated stream). ``gather`` is a collective over the tp group: every
    tp rank of a stage must call it for the same transfers in the same order (they run one action list).

    Args:
        group: the tp process group of this rank (``mesh.group("tp")``), of size > 1.
    """

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def part_numel(self, numel: int) -> int:
        """``k = ceil(numel / tp)``: the elements each tp rank sends of a tensor of ``numel`` elements."""
        return -(-numel // self.size)

    def part(self, tensor: torch.Tensor) -> torch.Tensor:
        """This tp rank's part of ``tensor``: 1-D, ``part_numel(tensor.numel())`` elements (a view of the
        contiguous tensor, unless zero padding completes the last parts)."""
        flat = tensor.reshape(-1)
        k = self.part_numel(flat.numel())
        piece = flat[self.rank * k : (self.rank + 1) * k]
        if piece.numel() < k:
            piece = torch.cat([piece, piece.new_zeros(k - piece.numel())])
        return piece

    def gather(self, part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole tensor of ``shape`` from this rank's received ``part`` (``part_numel`` elements): an
        all-gather over the tp group (on GPU a stream-ordered collective, no host synchronization)."""
        numel = math.prod(shape)
        full = torch.empty(self.size * part.numel(), dtype=part.dtype, device=part.device)
        all_gather_flat(full, part, group=self.group)
        return full[:numel].view(shape)
