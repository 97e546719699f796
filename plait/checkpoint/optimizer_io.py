"""The optimizer's part of an engine checkpoint: ZeRO's flat pieces as boxes of logical tensors.

- save: each rank's ZeRO pieces of each parameter (a flattened range of its tp-local shard) become
  ``optimizer.master.<name>`` and ``optimizer.<state>.<name>`` boxes of the logical tensor with vocabulary
  padding dropped; stage 0 (replicated) from dp rank 0 only; tp-replicated parameters from tp rank 0 only;
  tied head copies not at all (the embedding's entries serve both);
- load: ``flat_reader`` gives ``ZeroOptimizer.load_shard_state`` any flat range of a slot, read from the
  boxes the new layout needs (padding rows zero), whatever layout saved them.

The box arithmetic is ``plait.checkpoint.tp``'s (``shard_boxes``, ``read_box``).
"""

from __future__ import annotations

import math
import re

import torch

from plait.checkpoint.index import optimizer_key
from plait.checkpoint.model_io import checkpoint_name, is_tied_copy
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.tp import read_box, shard_boxes
from plait.checkpoint.writer import ShardItem
from plait.parallel.sharding import TPShard, logical_parts, split_flat
from plait.zero.slices import ShardState

_CHUNK_PREFIX = re.compile(r"^\d+\.")


def param_table(chunks: list, optimizer) -> dict:
    """ZeRO slot name -> (the ``LogicalPart``s under their checkpoint names, parameter), for the
    ``optimizer``'s module over this rank's model ``chunks`` (several: pipeline stages, whose slot names
    carry the chunk index)."""
    table, chunk_params = {}, {}
    strip = chunks[0] is not optimizer.module  # pipeline stages: ZeRO holds them in a ModuleList
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            chunk_params[id(p)] = (name, chunk)
    for name, p in optimizer.module.named_parameters():
        own, chunk = chunk_params.get(
            id(p), (_CHUNK_PREFIX.sub("", name) if strip else name, optimizer.module)
        )
        table[name] = (logical_parts(checkpoint_name(own, p, chunk), p), p)
    return table


def optimizer_items(table: dict, state: ShardState, mesh) -> list[ShardItem]:
    """The ``ShardItem``s this rank writes for the optimizer (see the module docstring)."""
    if state.replicated and mesh.rank("dp_cp") != 0:
        return []
    items = []
    for sl in state.slices:
        parts, param = table[sl.name]
        if is_tied_copy(param):
            continue
        for part, start, length, pos in split_flat(parts, sl.start, sl.length):
            if not part.spec.tp_split and mesh.tp_rank != 0:
                continue
            for kind, flat in [("master", sl.master)] + sorted(sl.state.items()):
                items += _part_items(
                    optimizer_key(kind, part.name), part.spec, flat[pos : pos + length], start
                )
    return items


def _part_items(key: str, spec: TPShard, flat: torch.Tensor, start: int) -> list[ShardItem]:
    """``flat``, the local-shard elements ``[start, start + len(flat))`` of logical tensor ``key``'s
    shard ``spec``, as ``ShardItem`` boxes (padding rows dropped)."""
    items = []
    for pos, (offsets, keep), lengths in shard_boxes(spec, start, flat.numel()):
        box = flat[pos : pos + math.prod(lengths)].view(lengths)
        if spec.dim is not None:
            box = box.narrow(spec.dim, 0, keep[spec.dim])
        if box.numel():
            items.append(ShardItem(key, box.detach(), spec.logical_shape, offsets))
    return items


def flat_reader(reader: CheckpointReader, table: dict):
    """``read(slot_name, kind, start, length)`` for ``ZeroOptimizer.load_shard_state``."""
    names = set(reader.names())

    def read(slot: str, kind: str, start: int, length: int) -> torch.Tensor:
        parts, _ = table[slot]
        out = [
            _read_part(reader, names, kind, part, lo, n)
            for part, lo, n, _ in split_flat(parts, start, length)
        ]
        return torch.cat(out) if out else torch.zeros(0)

    return read


def _read_part(
    reader: CheckpointReader, names: set, kind: str, part, start: int, length: int
) -> torch.Tensor:
    """float32 elements ``[start, start + length)`` of ``part``'s local shard, padding rows zero."""
    key = optimizer_key(kind, part.name)
    if kind == "master" and key not in names:
        key = part.name  # no master saved (e.g. a converted checkpoint)
    out = [
        read_box(reader, key, part.spec, box, lengths, dtype=torch.float32).reshape(-1)
        for _, box, lengths in shard_boxes(part.spec, start, length)
    ]
    return torch.cat(out) if out else torch.zeros(0)
