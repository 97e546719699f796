"""Collective, crash-safe checkpoint save: every rank writes its slices, rank 0 publishes.

``CheckpointWriter.save`` (all ranks of ``group`` call it together, inline or in a background thread):
every rank writes its slices to ``rank<RRRRR>.safetensors`` in a temporary ``<root>/.tmp-<tag>-<nonce>/``
that rank 0 created, fsyncing each and computing CRC-32s; rank 0 checks that the slices of every tensor tile
it exactly, writes ``meta.json`` and last ``index.json``, renames the folder to ``<root>/<tag>``, replaces
``latest`` and prunes to ``keep_last``; every rank raises the same ``CheckpointError`` on failure.

Ranks must share the file system holding ``root``. One writer per root at a time. The steps in order, with
each fsync: ``docs/checkpoints.md``.
"""
from __future__ import annotations

import copy
import os
import secrets
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.checkpoint.boxes import box_error, flat_range_boxes
from plait.checkpoint.dirs import check_tag, prune, publish, remove_leftovers
from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.index import (
    INDEX_FILE,
    META_FILE,
    RANK_META_FILE,
    build_index,
    dumps_index,
)
from plait.checkpoint.integrity import fsync_path, write_durable
from plait.checkpoint.meta import dumps, json_error
from plait.checkpoint.stfile import dtype_name, write_safetensors

PAUSE_ENV = "PLAIT_CHECKPOINT_TEST_PAUSE"  # "<phase>:<marker path>": tests kill a save mid-way


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
            raise ValueError(f"ShardItem {self.name!r} of tensor shape {list(self.tensor.shape)}: {err}")

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> ShardItem:
        """The whole tensor as one slice (replicated tensors: pass from one rank only)."""
        return cls(name, tensor, tuple(tensor.shape), (0,) * tensor.dim())

    @classmethod
    def from_flat(cls, name: str, flat: torch.Tensor, global_shape: Sequence[int],
                  start: int) -> list[ShardItem]:
        """Items for elements ``[start, start + flat.numel())`` of the row-major flattened logical
        tensor (a ZeRO partition of one parameter); ``flat`` is 1-D. At most ``2 * ndim - 1`` items."""
        out, pos = [], 0
        for offsets, lengths in flat_range_boxes(global_shape, start, start + flat.numel()):
            n = 1
            for s in lengths:
                n *= s
            out.append(cls(name, flat[pos:pos + n].view(lengths), tuple(global_shape), offsets))
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


def _pause(phase: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    want, _, marker = spec.partition(":")
    if want == phase:
        with open(marker, "w") as f:
            f.write(phase)
        time.sleep(3600)


class _Comm:
    """Object collectives over ``group`` (None: one process, collectives are no-ops)."""

    def __init__(self, group):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world = 1 if group is None else dist.get_world_size(group)

    def bcast(self, obj):
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def gather(self, obj):
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out


@dataclass
class _Job:
    root: str
    tag: str
    items: list
    meta: dict
    rank_meta: object
    keep_last: int | None
    max_file_bytes: int | None
    comm: _Comm
    error: str | None


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

    def __init__(self, root: str, group=None, keep_last: int | None = None,
                 max_file_bytes: int | None = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be None or >= 1, got {keep_last}")
        self.root = os.fspath(root)
        self.keep_last, self.max_file_bytes = keep_last, max_file_bytes
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self._group = group if group is not None and dist.get_world_size(group) > 1 else None
        self._side = None
        self._pending: SaveHandle | None = None

    def _comm(self, async_: bool) -> _Comm:
        if self._group is None:
            return _Comm(None)
        if not async_ and dist.get_backend(self._group) == "gloo" and self._side is None:
            return _Comm(self._group)
        if self._side is None:  # collective: every rank of the group reaches its first such save together
            self._side = dist.new_group(ranks=dist.get_process_group_ranks(self._group), backend="gloo",
                                        use_local_synchronization=True)
        return _Comm(self._side)

    def wait(self) -> None:
        """Wait for the previous async save; raise its error if nobody has seen it yet."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
            if pending.error is not None and not pending.observed:
                pending.wait()

    def save(self, tag: str, shards: Sequence[ShardItem], meta: dict | None = None,
             rank_meta=None, async_: bool = False) -> SaveHandle:
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
        error = None
        try:
            check_tag(tag)
            if not isinstance(meta if meta is not None else {}, dict):
                raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")
            err = json_error(meta or {}, "meta") or json_error(rank_meta, "rank_meta")
            if err:
                raise CheckpointError(f"cannot save checkpoint {tag!r}: {err}")
        except CheckpointError as e:
            error = f"rank {comm.rank}: {e}"
        items = [(s.name, s.tensor.detach().to("cpu", copy=True) if async_ else s.tensor.detach(),
                  s.global_shape, s.offsets) for s in shards] if error is None else []
        if async_:  # the caller may change its dicts while the thread writes
            meta, rank_meta = copy.deepcopy(meta), copy.deepcopy(rank_meta)
        job = _Job(self.root, tag, items, meta or {}, rank_meta, self.keep_last, self.max_file_bytes,
                   comm, error)
        if error is not None and comm.world == 1:
            raise CheckpointError(error.removeprefix("rank 0: "))
        if not async_:
            handle = SaveHandle()
            _run(job)
            return handle
        handle = SaveHandle()

        def target():
            try:
                _run(job)
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                handle.error = e

        handle._thread = threading.Thread(target=target, name=f"plait-ckpt-{tag}")
        handle._thread.start()
        self._pending = handle
        if error is not None:  # peers learn it from the collective; this rank raises now
            handle.observed = True
            raise CheckpointError(error)
        return handle


def save(root: str, tag: str, shards: Sequence[ShardItem], meta: dict | None = None, *, group=None,
         keep_last: int | None = None, async_: bool = False, rank_meta=None,
         max_file_bytes: int | None = None) -> SaveHandle:
    """One-shot ``CheckpointWriter(root, group, keep_last, max_file_bytes).save(...)``.

    For repeated async saves keep one ``CheckpointWriter`` so each save waits for the last.
    """
    return CheckpointWriter(root, group, keep_last, max_file_bytes).save(tag, shards, meta,
                                                                        rank_meta, async_)


def _write_rank_files(job: _Job, tmp: str) -> tuple[list[dict], dict]:
    rank, groups, size = job.comm.rank, [[]], 0
    for it in job.items:
        nbytes = it[1].numel() * it[1].element_size()
        if job.max_file_bytes and groups[-1] and size + nbytes > job.max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(it)
        size += nbytes
    slices, files = [], {}
    for k, group in enumerate(g for g in groups if g):
        fname = f"rank{rank:05d}.safetensors" if len(groups) == 1 else f"rank{rank:05d}-{k:03d}.safetensors"
        entries, seen = [], {}
        for name, tensor, shape, offsets in group:
            n = seen.get(name, 0)
            seen[name] = n + 1
            key = name if n == 0 else f"{name}#{n}"
            entries.append((key, tensor))
            slices.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(shape),
                           "offsets": list(offsets), "lengths": list(tensor.shape), "file": fname,
                           "key": key, "rank": rank})
        files[fname] = write_safetensors(os.path.join(tmp, fname), entries,
                                         after_tensor=lambda i: _pause("file"))
    return slices, files


def _run(job: _Job) -> None:
    comm = job.comm
    header = None
    if comm.rank == 0:
        nonce = secrets.token_hex(6)
        tmp = os.path.join(job.root, f".tmp-{job.tag}-{nonce}")
        try:
            os.makedirs(job.root, exist_ok=True)
            remove_leftovers(job.root, keep=tmp)
            os.mkdir(tmp)
            header = (tmp, nonce, job.tag, None)
        except OSError as e:
            header = (tmp, nonce, job.tag, f"rank 0 cannot create {tmp}: {e}")
    tmp, nonce, tag, error = comm.bcast(header)
    result = {"rank": comm.rank, "error": job.error, "slices": [], "files": {},
              "rank_meta": job.rank_meta if job.error is None else None}
    if result["error"] is None and tag != job.tag:
        result["error"] = f"rank {comm.rank} saves tag {job.tag!r} but rank 0 saves {tag!r}"
    if result["error"] is None and error is None:
        try:
            result["slices"], result["files"] = _write_rank_files(job, tmp)
        except Exception as e:  # noqa: BLE001 - reported collectively below
            result["error"] = f"rank {comm.rank} writing {tmp}: {type(e).__name__}: {e}"
    results = comm.gather(result)
    status = None
    if comm.rank == 0:
        errors = ([error] if error else []) + [r["error"] for r in results if r["error"]]
        try:
            if errors:
                raise CheckpointError("; ".join(errors))
            _finish(job, tmp, nonce, results)
        except Exception as e:  # noqa: BLE001 - broadcast to every rank
            status = str(e) if isinstance(e, CheckpointError) else f"rank 0: {type(e).__name__}: {e}"
            shutil.rmtree(tmp, ignore_errors=True)
    status = comm.bcast(status)
    if status is not None:
        raise CheckpointError(f"saving checkpoint {os.path.join(job.root, job.tag)} failed: {status}")


def _finish(job: _Job, tmp: str, nonce: str, results: list[dict]) -> None:
    """Rank 0: metadata, index, fsync, publish, prune."""
    files, slices = {}, []
    for r in results:
        files.update(r["files"])
        slices.extend(r["slices"])
    files[META_FILE] = write_durable(os.path.join(tmp, META_FILE), dumps(job.meta))
    rank_metas = [r["rank_meta"] for r in results]
    if any(m is not None for m in rank_metas):
        files[RANK_META_FILE] = write_durable(os.path.join(tmp, RANK_META_FILE), dumps(rank_metas))
    index = build_index(job.tag, slices, files, writers=job.comm.world, saved_at=time.time())
    _pause("index")
    write_durable(os.path.join(tmp, INDEX_FILE), dumps_index(index))
    fsync_path(tmp)
    publish(job.root, job.tag, tmp, nonce, pause=_pause)
    if job.keep_last is not None:
        prune(job.root, job.keep_last)
