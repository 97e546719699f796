"""How a parameter is split over the tensor-parallel group, and moving between whole and shard.

Every parameter of a plait layer carries a ``TPShard`` (attribute ``plait_shard``) saying
which dim is split over tp (None: replicated on every tp rank) and the *logical* shape:
the whole tensor as a single-process model has it, with no vocabulary padding. Padding
lives only in the local shards, so checkpoints, initialization and Hugging Face export
see logical tensors, and a shard converts to and from any other tp layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.parallel.collectives import all_gather_flat, group_size

ATTR = "plait_shard"


@dataclass(frozen=True)
class TPShard:
    """Placement of one parameter over the tp group.

    Attributes:
        logical_shape: the whole, unpadded tensor's shape.
        dim: dim split over tp, or None when every tp rank holds the whole tensor.
        padded: size of ``dim`` after padding to a multiple of tp (== logical size without padding).
        rank, world: this rank's position in, and the size of, the tp group.
    """

    logical_shape: tuple[int, ...]
    dim: int | None = None
    padded: int | None = None
    rank: int = 0
    world: int = 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.logical_shape
        shape = list(self.logical_shape)
        shape[self.dim] = self.padded_size // self.world
        return tuple(shape)

    @property
    def padded_size(self) -> int:
        return self.logical_shape[self.dim] if self.padded is None else self.padded

    def logical_range(self) -> tuple[int, int]:
        """``(start, stop)`` of the logical (unpadded) rows along ``dim`` that this shard holds;
        the shard's remaining rows (if any) are padding. ``(0, n)`` when replicated."""
        if self.dim is None:
            return 0, self.logical_shape[0] if self.logical_shape else 0
        chunk = self.padded_size // self.world
        size = self.logical_shape[self.dim]
        start = min(self.rank * chunk, size)
        return start, min(start + chunk, size)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole logical tensor (padding rows zero-filled)."""
        if tuple(full.shape) != tuple(self.logical_shape):
            raise ValueError(f"expected a tensor of logical shape {self.logical_shape}, "
                             f"got {tuple(full.shape)}")
        if self.dim is None:
            return full
        start, stop = self.logical_range()
        part = full.narrow(self.dim, start, stop - start)
        missing = self.local_shape[self.dim] - (stop - start)
        if missing:
            pad = [0, 0] * (full.dim() - 1 - self.dim) + [0, missing]
            part = F.pad(part, pad)
        return part.contiguous()

    def unpad(self, local: torch.Tensor) -> torch.Tensor:
        """The logical rows of a local shard (drops padding)."""
        if self.dim is None:
            return local
        start, stop = self.logical_range()
        return local.narrow(self.dim, 0, stop - start)


def shard_of(param: torch.Tensor) -> TPShard:
    """The ``TPShard`` of a parameter; a parameter without one is replicated with its own shape."""
    spec = getattr(param, ATTR, None)
    return spec if spec is not None else TPShard(tuple(param.shape))


def mark(param: torch.Tensor, spec: TPShard) -> torch.Tensor:
    """Attach ``spec`` to ``param`` after checking the local shape matches it."""
    if tuple(param.shape) != spec.local_shape:
        raise ValueError(f"parameter shape {tuple(param.shape)} does not match its shard "
                         f"{spec.local_shape} of logical {spec.logical_shape}")
    setattr(param, ATTR, spec)
    return param


def gather_full(local: torch.Tensor, spec: TPShard, group) -> torch.Tensor:
    """All-gather a tp shard into the whole logical tensor (padding removed). Collective over tp."""
    if spec.dim is None or group_size(group) == 1:
        return spec.unpad(local) if spec.dim is not None else local
    moved = local.detach().movedim(spec.dim, 0).contiguous()
    out = torch.empty((spec.world * moved.shape[0],) + tuple(moved.shape[1:]),
                      dtype=moved.dtype, device=moved.device)
    all_gather_flat(out, moved, group=group)
    full = out.movedim(0, spec.dim)
    return full.narrow(spec.dim, 0, spec.logical_shape[spec.dim]).contiguous()
