"""Offline rewrite of a checkpoint's files (``plait convert reshard``), in one process, no launcher.

plait checkpoints are layout-free: any tp/pp/dp/ZeRO layout loads any checkpoint directly, so changing the
layout needs no conversion. What ``reshard`` changes is the files: the slices that N writer ranks saved
become whole tensors, in files of at most ``max_file_bytes`` (e.g. thousands of per-rank files of a large
run into a few, to copy or archive), with everything else kept, so training resumes from the new root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.writer import CheckpointWriter, ShardItem


@dataclass(frozen=True)
class ReshardReport:
    """``path`` written; ``tensors`` count; ``slices_before`` (1 each now); ``files`` written;
    ``rng_kept``: the per-rank RNG states came along (only a one-rank checkpoint's can: a run of another
    world size reseeds, as after any layout change)."""

    path: str
    tensors: int
    slices_before: int
    files: list[str]
    rng_kept: bool


def reshard(
    plait_root: str, out_root: str, tag: str | None = None, max_file_bytes: int | None = None
) -> ReshardReport:
    """Rewrite checkpoint ``<plait_root>/<tag>`` (default: latest) as ``<out_root>/<tag>``: every tensor
    (model, optimizer state, extras) whole, in files of at most ``max_file_bytes`` (None: one file), with
    ``meta.json`` unchanged; ``out_root/latest`` names it. Holds the checkpoint in host memory (as
    ``consolidate`` does).

    Raises:
        CheckpointError: the source is missing or damaged (names the file), or ``out_root`` is the source root.
    """
    if os.path.realpath(out_root) == os.path.realpath(plait_root):
        raise CheckpointError(
            f"reshard writes a new checkpoint root; {out_root} is the source root: choose "
            f"another folder"
        )
    reader = CheckpointReader(plait_root, tag)
    names = reader.names()
    slices = sum(len(reader.index["tensors"][n]["slices"]) for n in names)
    rank_meta = reader.rank_meta()
    keep_rng = rank_meta is not None and len(rank_meta) == 1
    items = [ShardItem.whole(n, reader.read(n)) for n in names]
    writer = CheckpointWriter(out_root, max_file_bytes=max_file_bytes)
    writer.save(reader.tag, items, reader.meta, rank_meta=rank_meta[0] if keep_rng else None).wait()
    reader.close()
    path = os.path.join(out_root, reader.tag)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return ReshardReport(path, len(names), slices, files, keep_rng)
