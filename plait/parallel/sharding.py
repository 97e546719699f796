"""How a parameter is split over the tensor-parallel group, and moving between whole and shard.

Every parameter of a plait layer carries a ``TPShard`` (attribute ``plait_shard``) saying
which dim is split over tp (None: replicated on every tp rank) and the *logical* shape:
the whole tensor as a single-process model has it, with no vocabulary padding. Padding
lives only in the local shards, so checkpoints, initialization and Hugging Face export
see logical tensors, and a shard converts to and from any other tp layout.

A fused parameter (q/k/v as one column-parallel weight, SwiGLU's gate and up as one) carries a
``FusedShard`` instead: the tp shards of several logical tensors stacked along dim 0. Code that
reads or writes logical tensors goes through ``logical_parts``, so checkpoints, initialization and
Hugging Face conversion keep the logical names (``q_proj.weight``...) whatever the module holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
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
        rank, world: this rank's position in, and the size of, the group ``dim`` is split over.
        axis: that group's mesh dim: "tp", or "ep" for a mixture of experts' expert weights, split over the
            expert-parallel ranks (``plait.parallel.mesh``) and whole on every tp rank.
    """

    logical_shape: tuple[int, ...]
    dim: int | None = None
    padded: int | None = None
    rank: int = 0
    world: int = 1
    axis: str = "tp"

    @property
    def tp_split(self) -> bool:
        """True when the tp ranks hold different parts (False: every tp rank holds the same tensor)."""
        return self.dim is not None and self.axis == "tp"

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
            raise ValueError(
                f"expected a tensor of logical shape {self.logical_shape}, got {tuple(full.shape)}"
            )
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


@dataclass(frozen=True)
class FusedShard:
    """Several logical tensors' tp shards side by side along dim 0 of one parameter.

    Attributes:
        names: the logical tensors' module names, in the order their rows are stacked (e.g.
            ``("q_proj", "k_proj", "v_proj")``): parameter ``a.qkv_proj.weight`` holds
            ``a.q_proj.weight``, ``a.k_proj.weight`` and ``a.v_proj.weight``.
        parts: each logical tensor's ``TPShard``, split along dim 0 over the same tp group.

    Raises:
        ValueError: a part not split along dim 0, or parts whose other dims differ.
    """

    names: tuple[str, ...]
    parts: tuple[TPShard, ...]
    dim = 0  # class constants, not fields: the stacked dim, split over tp
    axis = "tp"
    tp_split = True

    def __post_init__(self):
        trailing = {tuple(p.local_shape[1:]) for p in self.parts}
        groups = {(p.rank, p.world) for p in self.parts}
        if (
            len(self.names) != len(self.parts)
            or len(trailing) != 1
            or len(groups) != 1
            or any(p.dim != 0 for p in self.parts)
        ):
            raise ValueError(
                f"a fused parameter stacks tp shards split along dim 0 over one tp group, with "
                f"equal trailing dims; got {list(zip(self.names, self.parts))}"
            )

    @property
    def local_shape(self) -> tuple[int, ...]:
        rows = sum(p.local_shape[0] for p in self.parts)
        return (rows,) + tuple(self.parts[0].local_shape[1:])


@dataclass(frozen=True)
class LogicalPart:
    """One logical tensor inside a parameter's local tensor: rows ``[row, row + spec.local_shape[0])``
    of dim 0 (the whole tensor for an unfused parameter, ``row`` 0), named ``name``, placed by ``spec``."""

    name: str
    spec: TPShard
    row: int = 0
    fused: bool = False

    @property
    def local_numel(self) -> int:
        """Elements of this part in the local tensor."""
        return math.prod(self.spec.local_shape)

    @property
    def flat_start(self) -> int:
        """Where this part starts in the flattened local tensor."""
        return self.row * math.prod(self.spec.local_shape[1:])

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (the parameter, its gradient or a buffer laid out like it)."""
        return tensor.narrow(0, self.row, self.spec.local_shape[0]) if self.fused else tensor


def logical_parts(name: str, param: torch.Tensor) -> list[LogicalPart]:
    """The logical tensors ``param`` (registered as ``name``) holds: one, named ``name``, for a plain
    parameter; one per fused tensor for a ``FusedShard`` (``a.qkv_proj.weight`` ->
    ``a.q_proj.weight``, ...)."""
    return _parts(name, shard_of(param))


def _parts(name: str, spec: TPShard | FusedShard) -> list[LogicalPart]:
    if not isinstance(spec, FusedShard):
        return [LogicalPart(name, spec)]
    owner, _, leaf = name.rpartition(".")
    prefix = owner.rpartition(".")[0]
    out, row = [], 0
    for module, part in zip(spec.names, spec.parts):
        out.append(LogicalPart(".".join(x for x in (prefix, module, leaf) if x), part, row, True))
        row += part.local_shape[0]
    return out


def split_flat(
    parts: list[LogicalPart], start: int, length: int
) -> Iterator[tuple[LogicalPart, int, int, int]]:
    """Split the flattened local elements ``[start, start + length)`` of one parameter over its parts:
    yields ``(part, part_start, n, pos)``: ``n`` elements from ``part_start`` in the part's own flat
    order, found at ``pos`` from ``start``."""
    for part in parts:
        lo = max(start, part.flat_start)
        hi = min(start + length, part.flat_start + part.local_numel)
        if hi > lo:
            yield part, lo - part.flat_start, hi - lo, lo - start


def shard_of(param: torch.Tensor) -> TPShard | FusedShard:
    """The ``TPShard`` (or ``FusedShard``) of a parameter; a parameter without one is replicated with
    its own shape."""
    spec = getattr(param, ATTR, None)
    return spec if spec is not None else TPShard(tuple(param.shape))


def mark(param: torch.Tensor, spec: TPShard | FusedShard) -> torch.Tensor:
    """Attach ``spec`` to ``param`` after checking the local shape matches it."""
    if tuple(param.shape) != spec.local_shape:
        raise ValueError(
            f"parameter shape {tuple(param.shape)} does not match its shard "
            f"{spec.local_shape} ({spec})"
        )
    setattr(param, ATTR, spec)
    return param


def gather_full(
    local: torch.Tensor, spec: TPShard | FusedShard, group, ep_group=None
) -> torch.Tensor:
    """All-gather a tp shard over the tp ``group`` (an expert shard, ``axis="ep"``, over ``ep_group``) into the
    whole logical tensor (padding removed). Collective over that group. A ``FusedShard`` gives its whole
    logical tensors concatenated along dim 0 (``gather_logical`` names them).

    Raises:
        ValueError: the shard's group has ``spec.world`` ranks but the group given another size."""
    if isinstance(spec, FusedShard):
        return torch.cat([gather_full(p.local(local), p.spec, group) for p in _parts("", spec)])
    if spec.axis != "tp":
        group = ep_group
    if spec.dim is not None and group_size(group) != spec.world:
        raise ValueError(
            f"a shard split over {spec.world} {spec.axis} ranks cannot be gathered over a group of "
            f"{group_size(group)}; pass the mesh's {spec.axis} group"
        )
    if spec.dim is None or group_size(group) == 1:
        return spec.unpad(local) if spec.dim is not None else local
    moved = local.detach().movedim(spec.dim, 0).contiguous()
    out = torch.empty(
        (spec.world * moved.shape[0],) + tuple(moved.shape[1:]),
        dtype=moved.dtype,
        device=moved.device,
    )
    all_gather_flat(out, moved, group=group)
    full = out.movedim(0, spec.dim)
    return full.narrow(spec.dim, 0, spec.logical_shape[spec.dim]).contiguous()


def gather_logical(
    name: str, param: torch.Tensor, group, tensor: torch.Tensor | None = None, ep_group=None
) -> dict:
    """``{logical name: whole tensor}`` of what ``param`` (registered as ``name``) holds, or of
    ``tensor`` laid out like it (e.g. ``param.grad``). Collective over tp (and ep, ``gather_full``)."""
    local = param.detach() if tensor is None else tensor
    return {
        p.name: gather_full(p.local(local), p.spec, group, ep_group)
        for p in logical_parts(name, param)
    }


def gather_logical_state(module, group=None, grads: bool = False, ep_group=None) -> dict:
    """``{logical name: whole tensor}`` of every parameter of ``module`` (or of its gradient, None
    entries left out with ``grads``): what a single-process model of the same architecture holds under
    those names, whatever the tp (and ep) layout and fusion. Collective over the tp ``group`` (and the
    expert-parallel ``ep_group``, for a mixture of experts' expert weights)."""
    out = {}
    for name, p in module.named_parameters():
        if grads and p.grad is None:
            continue
        out.update(gather_logical(name, p, group, p.grad if grads else None, ep_group))
    return out


def logical_numel(module) -> int:
    """Elements of the logical tensors of ``module``'s parameters (no vocabulary padding, any tp
    layout or fusion; a parameter shared by several modules counted once). Works on the meta device."""
    return sum(
        math.prod(part.spec.logical_shape)
        for name, p in module.named_parameters()
        for part in logical_parts(name, p)
    )
