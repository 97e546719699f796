"""One checkpoint save as every rank of the writer's group runs it (``run``), behind ``CheckpointWriter.save``.

Rank 0 creates ``<root>/.tmp-<tag>-<nonce>/`` and broadcasts it; every rank writes its slices to
``rank<RRRRR>.safetensors`` there (fsynced, with CRC-32s) and gathers what it wrote to rank 0; rank 0 checks
the slices tile every tensor, writes ``meta.json``, ``rank_meta.json`` and last ``index.json``, publishes the
folder as ``<root>/<tag>`` and prunes; the outcome is broadcast so every rank raises the same error.
``PAUSE_ENV`` lets tests kill a save at a named phase.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from dataclasses import dataclass

import torch.distributed as dist

from plait.checkpoint.dirs import prune, publish, remove_leftovers
from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.index import INDEX_FILE, META_FILE, RANK_META_FILE, build_index, dumps_index
from plait.checkpoint.integrity import fsync_path, write_durable
from plait.checkpoint.meta import dumps
from plait.checkpoint.stfile import dtype_name, write_safetensors

PAUSE_ENV = "PLAIT_CHECKPOINT_TEST_PAUSE"  # "<phase>:<marker path>": tests kill a save mid-way


def _pause(phase: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    want, _, marker = spec.partition(":")
    if want == phase:
        with open(marker, "w") as f:
            f.write(phase)
        time.sleep(3600)


class Comm:
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
class SaveJob:
    """One save as ``CheckpointWriter.save`` hands it to ``run``: this rank's items, rank 0's metadata, and
    the first error this rank found in its arguments (then it writes nothing but still takes part)."""

    root: str
    tag: str
    items: list
    meta: dict
    rank_meta: object
    keep_last: int | None
    max_file_bytes: int | None
    comm: Comm
    error: str | None


def _write_rank_files(job: SaveJob, tmp: str) -> tuple[list[dict], dict]:
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
        fname = (
            f"rank{rank:05d}.safetensors"
            if len(groups) == 1
            else f"rank{rank:05d}-{k:03d}.safetensors"
        )
        entries, seen = [], {}
        for name, tensor, shape, offsets in group:
            n = seen.get(name, 0)
            seen[name] = n + 1
            key = name if n == 0 else f"{name}#{n}"
            entries.append((key, tensor))
            slices.append(
                {
                    "name": name,
                    "dtype": dtype_name(tensor.dtype),
                    "shape": list(shape),
                    "offsets": list(offsets),
                    "lengths": list(tensor.shape),
                    "file": fname,
                    "key": key,
                    "rank": rank,
                }
            )
        files[fname] = write_safetensors(
            os.path.join(tmp, fname), entries, after_tensor=lambda i: _pause("file")
        )
    return slices, files


def run(job: SaveJob) -> None:
    """Every rank of ``job.comm``: the steps of the module docstring. Raises the same ``CheckpointError`` on
    every rank when any rank failed (nothing is published then)."""
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
    result = {
        "rank": comm.rank,
        "error": job.error,
        "slices": [],
        "files": {},
        "rank_meta": job.rank_meta if job.error is None else None,
    }
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
            status = (
                str(e) if isinstance(e, CheckpointError) else f"rank 0: {type(e).__name__}: {e}"
            )
            shutil.rmtree(tmp, ignore_errors=True)
    status = comm.bcast(status)
    if status is not None:
        raise CheckpointError(
            f"saving checkpoint {os.path.join(job.root, job.tag)} failed: {status}"
        )


def _finish(job: SaveJob, tmp: str, nonce: str, results: list[dict]) -> None:
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
