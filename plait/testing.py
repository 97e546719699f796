"""Run a function on N gloo processes on CPU: the multi-process test harness.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (forkserver
with torch preloaded, so start-up is cheap), initializes a gloo process group through a
file store in a fresh temporary directory (no rendezvous port to leak), calls
``fn(*args)`` on every rank and returns the list of per-rank return values.

A rank that raises has its formatted traceback re-raised in the caller as
``DistributedTestError``; a run that outlives ``timeout_s`` is killed whole and reported
with the ranks that had not finished. Every child is reaped before returning.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta


class DistributedTestError(AssertionError):
    """A rank raised, died, or the run timed out; the message holds each failing rank's traceback."""


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _worker(rank, world_size, store_path, results, fn, args, threads):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        # Plain pickle copies tensor data into bytes; the queue's own pickler would pass shared-memory
        # file descriptors that die with this process before the parent reads them.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
        _leave_together(dist)
    except BaseException:  # noqa: BLE001 - report anything, including SystemExit, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _leave_together(dist) -> None:
    """After a rank reported success: no rank tears its group down while another is still joining it
    (gloo's connectFullMesh then fails on the late rank with "Connection closed by peer", seen on a
    loaded 2-core machine). A peer that failed or froze makes this fail; its result is already sent."""
    try:
        dist.barrier()
    except RuntimeError:
        pass


def _collect(procs, results, world_size: int, timeout_s: float) -> dict[int, tuple[str, object]]:
    """Every rank's ``(status, value)`` from ``results`` until all reported, one died without reporting, or the
    deadline (``timeout_s``; 5 s after the first error, for peers to report too)."""
    outcomes: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcomes) < world_size:
        try:
            rank, status, value = results.get(timeout=0.2)
            outcomes[rank] = (status, value)
            if status == "error":  # give peers a moment to report too, then stop
                deadline = min(deadline, time.monotonic() + 5.0)
            continue
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
        if dead:
            time.sleep(0.5)  # a result may still be in flight through the queue
            while not results.empty():
                rank, status, value = results.get()
                outcomes[rank] = (status, value)
            for r in dead:
                outcomes.setdefault(
                    r,
                    (
                        "error",
                        f"process exited with code {procs[r].exitcode} without reporting a result",
                    ),
                )
        if time.monotonic() > deadline:
            break
    return outcomes


def _raise_failures(name: str, world_size: int, outcomes: dict, timeout_s: float) -> None:
    """Raise ``DistributedTestError`` with every failed rank's traceback and the ranks that never finished."""
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            parts.append(f"ranks {missing} did not finish within {timeout_s:.0f}s (killed)")
        raise DistributedTestError(f"{name} on {world_size} ranks failed:\n" + "\n".join(parts))


def run_distributed(fn, world_size: int, *args, timeout_s: float = 240.0, threads: int = 1):
    """Call ``fn(*args)`` on ``world_size`` gloo ranks; return ``[result_rank0, result_rank1, ...]``.

    ``fn`` must be a module-level (picklable) function; inside it, ``torch.distributed`` is
    initialized and ``dist.get_rank()`` tells the rank. Results must be picklable.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message), a process exited
            without reporting, or the run exceeded ``timeout_s`` seconds.
    """
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="plait-dist-") as tmp:
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, world_size, os.path.join(tmp, "store"), results, fn, args, threads),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            outcomes = _collect(procs, results, world_size, timeout_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            results.close()
            results.join_thread()
    _raise_failures(fn.__name__, world_size, outcomes, timeout_s)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
