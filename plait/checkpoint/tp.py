"""Tensor-parallel shards (``TPShard``) as checkpoint boxes: save the unpadded part, load box + pad.

A tp shard of a logical tensor is the box ``logical_range()`` along ``spec.dim`` (whole along
every other dim); its remaining rows along ``dim`` are padding (e.g. a vocabulary padded to a
multiple of tp) and are never stored. Loading a shard reads that box from whatever layout was
saved and zero-fills the padding, so a checkpoint saved at tp=4 loads at tp=3.

The padded-box arithmetic lives here only: ``logical_box`` maps a box of the local (padded) shard to
the logical box it holds; ``shard_boxes`` does it for a flat range of the shard (a ZeRO partition);
``read_box`` reads one back with its padding rows zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.checkpoint.boxes import Box, flat_range_boxes, volume
from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.writer import ShardItem
from plait.parallel.sharding import TPShard


def logical_box(spec: TPShard, offsets, lengths) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A box ``(offsets, lengths)`` of the local shard ``spec`` as ``(logical offsets, kept lengths)``: the
    logical elements it holds, its padding rows along ``spec.dim`` cut (kept length 0 for padding only)."""
    offsets, keep = list(offsets), list(lengths)
    if spec.dim is not None:
        d = spec.dim
        start, stop = spec.logical_range()
        keep[d] = max(0, min(offsets[d] + lengths[d], stop - start) - offsets[d])
        offsets[d] += start
    return tuple(offsets), tuple(keep)


def tp_box(spec: TPShard) -> Box:
    """``(offsets, lengths)`` of the logical elements the shard ``spec`` holds (padding excluded).

    Replicated (``spec.dim is None``): the whole tensor. A shard made only of padding has
    length 0 along ``dim``.
    """
    return logical_box(spec, (0,) * len(spec.local_shape), spec.local_shape)


def shard_boxes(spec: TPShard, start: int, length: int) -> list[tuple[int, Box, tuple[int, ...]]]:
    """The flattened local-shard elements ``[start, start + length)`` of ``spec`` as
    ``(position in the range, logical box, local lengths)``, in flat order; a box's lengths are the kept
    ones (``logical_box``), the local lengths count its padding rows too."""
    out, pos = [], 0
    for offsets, lengths in flat_range_boxes(spec.local_shape, start, start + length):
        out.append((pos, logical_box(spec, offsets, lengths), tuple(lengths)))
        pos += volume(lengths)
    return out


def read_box(
    reader,
    name: str,
    spec: TPShard,
    box: Box,
    local_lengths,
    dtype: torch.dtype | None = None,
    device=None,
) -> torch.Tensor:
    """Logical ``box`` of ``name`` (from ``logical_box``) in the local shape ``local_lengths``: the padding
    rows along ``spec.dim`` zero."""
    part = reader.read(name, box[0], box[1], dtype=dtype, device=device)
    if spec.dim is None:
        return part
    missing = local_lengths[spec.dim] - box[1][spec.dim]
    if missing:
        part = F.pad(part, [0, 0] * (part.dim() - 1 - spec.dim) + [0, missing])
    return part


def tp_shard_item(name: str, local: torch.Tensor, spec: TPShard) -> ShardItem | None:
    """The ``ShardItem`` saving local shard ``local`` (shape ``spec.local_shape``) without padding;
    None when the shard holds only padding. The caller passes it from the owning rank only
    (e.g. dp rank 0; for replicated params also tp rank 0).

    Raises:
        ValueError: ``local`` does not have ``spec.local_shape``.
    """
    if tuple(local.shape) != tuple(spec.local_shape):
        raise ValueError(
            f"tensor {name!r}: local shard shape {list(local.shape)} is not the shard "
            f"shape {list(spec.local_shape)} of logical {list(spec.logical_shape)}"
        )
    offsets, lengths = tp_box(spec)
    if spec.dim is not None and lengths[spec.dim] == 0:
        return None
    return ShardItem(name, spec.unpad(local), spec.logical_shape, offsets)


def read_tp_shard(
    reader, name: str, spec: TPShard, dtype: torch.dtype | None = None, device=None
) -> torch.Tensor:
    """Load this rank's shard of ``name`` for placement ``spec``: shape ``spec.local_shape``,
    padding rows zero.

    Raises:
        CheckpointError: the checkpoint's logical shape differs from ``spec.logical_shape``
            (message names the tensor and both shapes).
    """
    stored = reader.shape(name)
    if tuple(stored) != tuple(spec.logical_shape):
        raise CheckpointError(
            f"tensor {name!r}: the checkpoint {reader.path} has logical shape "
            f"{list(stored)}, the model's shard expects {list(spec.logical_shape)}"
        )
    return read_box(reader, name, spec, tp_box(spec), spec.local_shape, dtype=dtype, device=device)
