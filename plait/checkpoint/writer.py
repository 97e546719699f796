"""Collective, crash-safe checkpoint save: every rank writes its slices, rank 0 publishes.

``CheckpointWriter.save`` (all ranks of ``group`` call it together, inline or in a background thread):
every rank writes its slices to ``rank<RRRRR>.safetensors`` in a temporary ``<root>/.tmp-<tag>-<nonce>/``
that rank 0 created, fsyncing each and computing CRC-32s; rank 0 checks that the slices of every tensor tile
it exactly, writes ``meta.json`` and last ``index.json``, renames the folder to ``<root>/<tag>``, replaces
``latest`` and prunes to ``keep_last``; every rank raises the same ``CheckpointError`` on failure.

Ranks must share the file system holding ``root``. One writer per root at a time. The protocol every rank
runs is ``save_job``; the steps in order, with each fsync: ``docs/checkpoints.md``.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.checkpoint.boxes import box_error, flat_range_boxes
from plait.checkpoint.dirs import check_tag
from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.meta import json_error
from plait.checkpoint.save_job import Comm, SaveJob, run
from plait.checkpoint.stfile import dtype_name


@dataclass(frozen=True)
class ShardItem:
    """One box of a logical tensor that this rank saves.

    Attributes:
        name: logical name, e.g. ``layers.3.attn.q_proj.weight`` or
            ``optimizer.exp_avg.layers.3.attn.q_proj.weight`` (see ``optimizer_key``).
        tensor: the box's values, shape ``lengths`` (any device, any strides, no padding).
        global_shape: shape of the whole logical tensor.
        offsets: index of ``tensor[0, 0, ...]`` in the logical tensor, one int per dim.

    The caller decides ownership: every element of every tensor must be passed by exactly one
    rank (a replicated tensor by one rank only), else the save fails naming the tensor.

    Raises:
        ValueError: the box does not fit in ``global_shape`` or the dtype cannot be stored.
        TypeError: ``tensor`` is not a ``torch.Tensor``.
    """

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ShardItem name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"ShardItem {self.name!r}: tensor is a {type(self.tensor).__name__}")
        dtype_name(self.tensor.dtype)
        err = box_error(self.global_shape, self.offsets, tuple(self.tensor.shape))
        if err:
            raise ValueError(
                f"ShardItem {self.name!r} of tensor shape {list(self.tensor.shape)}: {err}"
            )

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> ShardItem:
        """The whole tensor as one slice (replicated tensors: pass from one rank only)."""
        return cls(name, tensor, tuple(tensor.shape), (0,) * tensor.dim())

    @classmethod
    def from_flat(
        cls, name: str, flat: torch.Tensor, global_shape: Sequence[int], start: int
    ) -> list[ShardItem]:
        """Items for elements ``[start, start + flat.numel())`` of the row-major flattened logical
        tensor (a ZeRO partition of one parameter); ``flat`` is 1-D. At most ``2 * ndim - 1`` items."""
        out, pos = [], 0
        for offsets, lengths in flat_range_boxes(global_shape, start, start + flat.numel()):
            n = 1
            for s in lengths:
                n *= s
            out.append(cls(name, flat[pos : pos + n].view(lengths), tuple(global_shape), offsets))
            pos += n
        return out


class SaveHandle:
    """Result of ``save``: ``wait()`` blocks until the checkpoint is published (or raises)."""

    def __init__(self, thread: threading.Thread | None = None):
        self._thread, self.error, self.observed = thread, None, False

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        """Block until the save finished. Raises its ``CheckpointError`` (or other error) if it failed."""
        self.join()
        self.observed = True
        if self.error is not None:
            raise self.error


class CheckpointWriter:
    """Saves checkpoints into one ``root``, collectively over ``group``; owns the async queue.

    Args:
        root: directory holding the checkpoints (created if missing; shared by all ranks).
        group: process group of the writing ranks; None: the default group if initialized,
            else a single process.
        keep_last: after each save keep only this many newest checkpoints (None: keep all).
        max_file_bytes: start a new file when a rank's file would exceed this many bytes
            (None: one file per rank).
    """

    def __init__(
        self, root: str, group=None, keep_last: int | None = None, max_file_bytes: int | None = None
    ):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be None or >= 1, got {keep_last}")
        self.root = os.fspath(root)
        self.keep_last, self.max_file_bytes = keep_last, max_file_bytes
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self._group = group if group is not None and dist.get_world_size(group) > 1 else None
        self._side = None
        self._pending: SaveHandle | None = None

    def _comm(self, async_: bool) -> Comm:
        if self._group is None:
            return Comm(None)
        if not async_ and dist.get_backend(self._group) == "gloo" and self._side is None:
            return Comm(self._group)
        if (
            self._side is None
        ):  # collective: every rank of the group reaches its first such save together
            self._side = dist.new_group(
                ranks=dist.get_process_group_ranks(self._group),
                backend="gloo",
                use_local_synchronization=True,
            )
        return Comm(self._side)

    def wait(self) -> None:
        """Wait for the previous async save; raise its error if nobody has seen it yet."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
            if pending.error is not None and not pending.observed:
                pending.wait()

    def save(
        self,
        tag: str,
        shards: Sequence[ShardItem],
        meta: dict | None = None,
        rank_meta=None,
        async_: bool = False,
    ) -> SaveHandle:
        """Save ``shards`` (this rank's boxes) as checkpoint ``<root>/<tag>``; collective over the group.

        Args:
            tag: checkpoint name, e.g. ``"step1000"``; an existing one is replaced safely.
            shards: this rank's ``ShardItem``s (may be empty).
            meta: JSON dict written as ``meta.json`` (rank 0's is used): step counters, config,
                scheduler, loss scaler, data position, ``client_state``, ...
            rank_meta: JSON value per rank (e.g. that rank's RNG states via ``tensor_to_json``),
                stored as the list ``rank_meta.json`` in group-rank order when any rank passes one.
            async_: copy the tensors to host memory now and write in a background thread; the
                returned handle's ``wait()`` finishes it. A later save waits for this one.

        Raises:
            CheckpointError: bad tag, non-JSON metadata (message gives the key path), slices that
                do not tile a tensor, ranks disagreeing on a shape or dtype, or an I/O failure.
        """
        self.wait()
        comm = self._comm(async_)
        error = _argument_error(tag, meta, rank_meta)
        error = None if error is None else f"rank {comm.rank}: {error}"
        items = _held(shards, async_) if error is None else []
        if async_:  # the caller may change its dicts while the thread writes
            meta, rank_meta = copy.deepcopy(meta), copy.deepcopy(rank_meta)
        job = SaveJob(
            self.root,
            tag,
            items,
            meta or {},
            rank_meta,
            self.keep_last,
            self.max_file_bytes,
            comm,
            error,
        )
        if error is not None and comm.world == 1:
            raise CheckpointError(error.removeprefix("rank 0: "))
        if not async_:
            handle = SaveHandle()
            run(job)
            return handle
        self._pending = handle = _start(job, tag)
        if error is not None:  # peers learn it from the collective; this rank raises now
            handle.observed = True
            raise CheckpointError(error)
        return handle


def _held(shards: Sequence[ShardItem], async_: bool) -> list[tuple]:
    """``(name, tensor, global_shape, offsets)`` of each shard, the tensor detached (and copied to host
    memory for an async save, so the caller may change it while the thread writes)."""
    out = []
    for s in shards:
        tensor = s.tensor.detach().to("cpu", copy=True) if async_ else s.tensor.detach()
        out.append((s.name, tensor, s.global_shape, s.offsets))
    return out


def _argument_error(tag: str, meta, rank_meta) -> str | None:
    """What is wrong with ``save``'s arguments (the tag, non-JSON metadata), or None."""
    try:
        check_tag(tag)
        if not isinstance(meta if meta is not None else {}, dict):
            raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")
        err = json_error(meta or {}, "meta") or json_error(rank_meta, "rank_meta")
        if err:
            raise CheckpointError(f"cannot save checkpoint {tag!r}: {err}")
    except CheckpointError as e:
        return str(e)
    return None


def _start(job: SaveJob, tag: str) -> SaveHandle:
    """``run(job)`` in a background thread; its error goes to the handle (``wait()`` raises it)."""
    handle = SaveHandle()

    def target():
        try:
            run(job)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            handle.error = e

    handle._thread = threading.Thread(target=target, name=f"plait-ckpt-{tag}")
    handle._thread.start()
    return handle


def save(
    root: str,
    tag: str,
    shards: Sequence[ShardItem],
    meta: dict | None = None,
    *,
    group=None,
    keep_last: int | None = None,
    async_: bool = False,
    rank_meta=None,
    max_file_bytes: int | None = None,
) -> SaveHandle:
    """One-shot ``CheckpointWriter(root, group, keep_last, max_file_bytes).save(...)``.

    For repeated async saves keep one ``CheckpointWriter`` so each save waits for the last.
    """
    return CheckpointWriter(root, group, keep_last, max_file_bytes).save(
        tag, shards, meta, rank_meta, async_
    )
