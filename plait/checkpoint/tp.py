"""Tensor-parallel shards (``TPShard``) as checkpoint boxes: save the unpadded part, load box + pad.

A tp shard of a logical tensor is the box ``logical_range()`` along ``spec.dim`` (whole along
every other dim); its remaining rows along ``dim`` are padding (e.g. a vocabulary padded to a
multiple of tp) and are never stored. Loading a shard reads that box from whatever layout was
saved and zero-fills the padding, so a checkpoint saved at tp=4 loads at tp=3.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.checkpoint.boxes import Box
from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.writer import ShardItem
from plait.parallel.sharding import TPShard


def tp_box(spec: TPShard) -> Box:
    """``(offsets, lengths)`` of the logical elements the shard ``spec`` holds (padding excluded).

    Replicated (``spec.dim is None``): the whole tensor. A shard made only of padding has
    length 0 along ``dim``.
    """
    shape = tuple(spec.logical_shape)
    offsets, lengths = [0] * len(shape), list(shape)
    if spec.dim is not None:
        start, stop = spec.logical_range()
        offsets[spec.dim], lengths[spec.dim] = start, stop - start
    return tuple(offsets), tuple(lengths)


def tp_shard_item(name: str, local: torch.Tensor, spec: TPShard) -> ShardItem | None:
    """The ``ShardItem`` saving local shard ``local`` (shape ``spec.local_shape``) without padding;
    None when the shard holds only padding. The caller passes it from the owning rank only
    (e.g. dp rank 0; for replicated params also tp rank 0).

    Raises:
        ValueError: ``local`` does not have ``spec.local_shape``.
    """
    if tuple(local.shape) != tuple(spec.local_shape):
        raise ValueError(f"tensor {name!r}: local shard shape {list(local.shape)} is not the shard "
                         f"shape {list(spec.local_shape)} of logical {list(spec.logical_shape)}")
    offsets, lengths = tp_box(spec)
    if spec.dim is not None and lengths[spec.dim] == 0:
        return None
    return ShardItem(name, spec.unpad(local), spec.logical_shape, offsets)


def read_tp_shard(reader, name: str, spec: TPShard, dtype: torch.dtype | None = None,
                  device=None) -> torch.Tensor:
    """Load this rank's shard of ``name`` for placement ``spec``: shape ``spec.local_shape``,
    padding rows zero.

    Raises:
        CheckpointError: the checkpoint's logical shape differs from ``spec.logical_shape``
            (message names the tensor and both shapes).
    """
    stored = reader.shape(name)
    if tuple(stored) != tuple(spec.logical_shape):
        raise CheckpointError(f"tensor {name!r}: the checkpoint {reader.path} has logical shape "
                              f"{list(stored)}, the model's shard expects {list(spec.logical_shape)}")
    offsets, lengths = tp_box(spec)
    part = reader.read(name, offsets, lengths, dtype=dtype, device=device)
    if spec.dim is None:
        return part
    missing = spec.local_shape[spec.dim] - lengths[spec.dim]
    if missing:
        part = F.pad(part, [0, 0] * (part.dim() - 1 - spec.dim) + [0, missing])
    return part
