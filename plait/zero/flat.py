"""Flat buffers for ZeRO: parameters packed into padded segments split evenly over dp ranks
(Rajbhandari et al., SC'20, Sec. 5).

A ``Segment`` is a run of parameters of one dtype and param group, flattened back to back and
zero-padded to a multiple of the dp size; rank ``r`` owns ``[r*S, (r+1)*S)``, ``S = padded / world``
(a parameter may be split between two ranks). A ``FlatGroup`` is the segments sharing a ``GroupKey``;
the rank's *shard* of a group (the concatenation of its slices) is one 1-D tensor holding the fp32
masters and optimizer state. ``build_layout`` builds them; ``plait.zero.slices`` reads and writes a rank's
states for checkpoints. No process groups here (``plait.zero.comm``). Layout in
detail: ``docs/zero.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class GroupKey(NamedTuple):
    """What parameters must share to live in one flat group (and one master tensor)."""

    param_group: int  # index of the optimizer param group (lr, weight decay, ...)
    dtype: torch.dtype  # compute dtype of the model parameters
    tp_replicated: bool  # ``plait_shard.dim is None``: counted once over tp in the grad norm
    persistent: bool = False  # stage 3: kept whole on every rank (numel < persistence threshold)
    unit: int | None = (
        None  # stage 3: the unit holding these parameters (one flat group, master and
    )
    #                           gradient shard per unit, as FSDP2 keeps one per fully_shard module)
    experts: bool = (
        False  # expert weights split over ep ranks: sharded over the expert-data-parallel ranks
    )
    resident: bool = (
        False  # offload: master and optimizer state in device memory (``offload.placement``)
    )
    cast: bool = False  # stage 3: gathered in a narrower dtype (``plait.zero.gather_cast``)


@dataclass(eq=False)
class Slot:
    """One parameter's place in its segment: elements ``[offset, offset + numel)``."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


@dataclass(eq=False)
class Piece:
    """The part of one parameter that this rank owns: flattened elements ``[start, start+length)``
    of the parameter, stored at ``[shard_offset, shard_offset+length)`` of the flat group's shard."""

    slot: Slot
    start: int
    length: int
    shard_offset: int


@dataclass(eq=False)
class Segment:
    """A padded run of parameters; see the module docstring.

    Runtime fields: ``full`` is the whole padded buffer ``[padded]`` in the compute dtype while it
    exists (always for stages 0-2 and stage-3 persistent segments; only while gathered for other
    stage-3 segments); ``local`` is this rank's ``[S]`` slice in the compute dtype (stage 3 only);
    ``source``, when set, is the fp32 master ``[S]`` slice that ``local`` is made from on demand
    (``shard()``; stage 3 with the masters beside the parameters), ``local`` holding no storage otherwise.
    """

    key: GroupKey
    slots: list[Slot]
    numel: int
    world: int
    rank: int
    group: int = 0  # index of the flat group in the layout
    shard_offset: int = 0  # where this rank's slice starts in the flat group's shard
    unit: int | None = None  # stage 3: index of the unit that owns these parameters
    full: torch.Tensor | None = field(default=None, repr=False)
    local: torch.Tensor | None = field(default=None, repr=False)
    source: torch.Tensor | None = field(default=None, repr=False)

    @property
    def padded(self) -> int:
        return -(-self.numel // self.world) * self.world

    @property
    def shard_size(self) -> int:
        return self.padded // self.world

    @property
    def lo(self) -> int:
        """First element of the segment this rank owns."""
        return self.rank * self.shard_size

    def pieces(self) -> list[Piece]:
        """The parts of each parameter inside this rank's slice ``[lo, lo + S)``."""
        lo, hi = self.lo, self.lo + self.shard_size
        out = []
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                out.append(Piece(slot, a - slot.offset, b - a, self.shard_offset + a - lo))
        return out

    def pack(
        self,
        get: Callable[[Slot], torch.Tensor | None],
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
        device: torch.device | None = None,
        batched: bool = False,
    ) -> torch.Tensor:
        """A ``[padded]`` tensor of ``dtype`` holding ``get(slot)`` for each slot, zero elsewhere
        (``None``: zero), on ``device`` (default: the first parameter's). Written into ``out`` when given;
        only the gaps are zero-filled, so each element is written once. ``batched``: one
        ``torch._foreach_copy_`` for all slots (a casting copy, bf16 -> fp32, is vectorized there and not in
        ``Tensor.copy_``); only for a ``get`` returning tensors that exist anyway (gradients), since every
        value is held until the end."""
        device = device if device is not None else self.slots[0].param.device
        if out is None:
            out = torch.empty(self.padded, dtype=dtype, device=device)
        pos, dests, values = 0, [], []
        for slot in self.slots:
            if slot.offset > pos:
                out[pos : slot.offset].zero_()
            value = get(slot)
            dest = out[slot.offset : slot.offset + slot.numel]
            if value is None:
                dest.zero_()
            elif batched:
                dests.append(dest)
                values.append(value.reshape(-1))
            else:
                dest.copy_(value.reshape(-1))
            pos = slot.offset + slot.numel
        if pos < self.padded:
            out[pos:].zero_()
        if dests:
            torch._foreach_copy_(dests, values)
        return out

    def shard(self) -> torch.Tensor:
        """``local`` holding this rank's current values: cast from ``source`` when it is derived."""
        if self.source is not None:
            storage = self.local.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(self.local.numel() * self.local.element_size())
            self.local.copy_(self.source)
        return self.local

    def drop_shard(self) -> None:
        """Give back ``local``'s storage when it is derived from ``source`` (``shard()`` makes it again)."""
        if self.source is not None and self.local.untyped_storage().resizable():
            self.local.untyped_storage().resize_(0)

    def set_views(self, full: torch.Tensor) -> None:
        """Point every parameter's ``.data`` at its place in ``full`` (``[padded]``)."""
        self.full = full
        for slot in self.slots:
            slot.param.data = full[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def free(self) -> None:
        """Drop the full buffer; parameters become empty ``[0]`` tensors (storage released) of the compute
        dtype (``local``'s, at stage 3), so a released parameter still tells its dtype (a pipeline's
        activations, ``model.dtype`` of a Hugging Face model)."""
        self.full = None
        for slot in self.slots:
            dtype = slot.param.dtype if self.local is None else self.local.dtype
            slot.param.data = torch.empty(0, dtype=dtype, device=slot.param.device)


@dataclass(eq=False)
class FlatGroup:
    """Segments sharing one ``GroupKey``; ``shard_numel`` is the length of this rank's shard."""

    key: GroupKey
    segments: list[Segment]
    shard_numel: int

    def pieces(self) -> list[Piece]:
        return [p for seg in self.segments for p in seg.pieces()]


@dataclass
class Entry:
    """Input to ``build_layout``: one parameter and where it goes."""

    name: str
    param: torch.nn.Parameter
    key: GroupKey
    unit: int | None = None


def build_layout(
    entries: list[Entry],
    world: int,
    rank: int,
    bucket_numel: int,
    experts: tuple[int, int] | None = None,
) -> list[FlatGroup]:
    """Pack ``entries`` (in the given order) into flat groups of segments, split over ``world`` ranks (this
    one ``rank``), those of ``GroupKey.experts`` over ``experts = (world, rank)`` (default the same).

    A segment holds parameters of one key (and one unit, for stage 3) and is closed when adding the
    next parameter would take it past ``bucket_numel`` elements; a parameter larger than the bucket
    gets a segment of its own. Flat groups come in order of first appearance of their key.

    Raises:
        ValueError: a world < 1, a rank outside ``[0, world)`` or ``bucket_numel`` < 1.
    """
    experts = experts or (world, rank)
    for w, r in ((world, rank), experts):
        if w < 1 or not 0 <= r < w:
            raise ValueError(f"need 0 <= rank < world, got rank {r} and world {w}")
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be at least 1 element, got {bucket_numel}")
    by_key: dict[GroupKey, list[Segment]] = {}
    open_seg: dict[GroupKey, Segment] = {}
    for e in entries:
        n = e.param.numel()
        seg = open_seg.get(e.key)
        if seg is None or seg.unit != e.unit or (seg.numel + n > bucket_numel and seg.numel > 0):
            seg = Segment(e.key, [], 0, *(experts if e.key.experts else (world, rank)), unit=e.unit)
            open_seg[e.key] = seg
            by_key.setdefault(e.key, []).append(seg)
        seg.slots.append(Slot(e.name, e.param, seg.numel, n, e.param.shape))
        seg.numel += n
    groups = []
    for gi, (key, segs) in enumerate(by_key.items()):
        offset = 0
        for seg in segs:
            seg.group, seg.shard_offset = gi, offset
            offset += seg.shard_size
        groups.append(FlatGroup(key, segs, offset))
    return groups


def rebind_views(groups: list[FlatGroup]) -> None:
    """Point parameters back at their flat buffers where something replaced their ``.data``.

    A ``module.to(device)`` on an already-placed model (accelerate's ``prepare_model``, run by the
    Hugging Face Trainer's ``evaluate``) can hand parameters copies of their values; later steps then
    update the flat buffers the model no longer reads. Every parameter is checked (a pointer
    comparison each); DeepSpeed's stage 1/2 re-points its parameters after every step for the same
    reason. Stage-3 shards (``seg.local``) are left alone.
    """
    for group in groups:
        for seg in group.segments:
            if seg.full is None or seg.local is not None:
                continue
            base, size = seg.full.data_ptr(), seg.full.element_size()
            if any(s.param.data_ptr() != base + s.offset * size for s in seg.slots):
                seg.set_views(seg.full)
