"""Process start-up from torchrun's or SLURM's environment.

``init_distributed()`` reads the launcher's variables, picks NCCL when this node has
a CUDA device for each of its ranks and gloo (CPU ranks) otherwise, binds the local
GPU, and initializes the default process group. It returns the rank facts; the process group itself lives in
torch.distributed, and plait code reaches it only through a ``ParallelMesh``.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.parallel.rank_errors import report_errors_once


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits: global rank, world size, rank on its node, rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int = (
        1  # processes on this node (torchrun's LOCAL_WORLD_SIZE, SLURM's tasks per node)
    )


def first_slurm_host(nodelist: str) -> str:
    """First hostname of a SLURM node list: ``"gpu[003-005,9],cpu1"`` -> ``"gpu003"``.

    Raises:
        ValueError: when the list is empty or malformed.
    """
    nodelist = nodelist.strip()
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not nodelist or match is None:
        raise ValueError(f"cannot parse SLURM_NODELIST {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def launch_info(env: dict | None = None) -> LaunchInfo:
    """Read rank facts from torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) or SLURM
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODELIST). torchrun's variables win when both
    are present. Without either, a single process on 127.0.0.1.

    Raises:
        ValueError: rank not below world size.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
        addr = env.get("MASTER_ADDR", "127.0.0.1")
    elif "SLURM_PROCID" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", 1))
        local = int(env.get("SLURM_LOCALID", 0))
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1"))
    else:
        rank, world, local, addr = 0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1")
    port = int(env.get("MASTER_PORT", 29500))
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, world size {world})")
    per_node = (
        env.get("LOCAL_WORLD_SIZE")
        or env.get("SLURM_STEP_TASKS_PER_NODE")
        or env.get("SLURM_NTASKS_PER_NODE")
        or "0"
    )
    per_node = int(
        re.match(r"\d*", per_node).group() or 0
    )  # SLURM writes "4(x2)" for 4 on each of 2 nodes
    return LaunchInfo(rank, world, local, addr, port, max(per_node, local + 1))


def launcher_world_size(env: dict | None = None) -> int:
    """The number of processes a launcher started (torchrun's ``WORLD_SIZE``, SLURM's ``SLURM_NTASKS``), 1
    without one: more than 1 means this process must join a process group before it trains."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    return int(env.get("SLURM_NTASKS", 1)) if "SLURM_PROCID" in env else 1


STARTUP_TIMEOUT_S = (
    600.0  # until an engine applies its config's comm timeouts (comm.startup_timeout_s's default)
)
SCRIPT_TIMEOUT_KEY = (
    "plait/script_timeout_s/{rank}"  # in the group's store: a timeout the script chose
)


def choose_backend(
    info: LaunchInfo, device_count: int, backend: str | None = None
) -> tuple[str, str | None]:
    """The process-group backend for this node's ranks, and a one-line notice for rank 0 (or None).

    NCCL when the node has a CUDA device for each of its ``info.local_world_size`` ranks, gloo (CPU ranks)
    otherwise: ``torchrun --nproc-per-node 4`` then runs on 0, 1, 2 or 4 GPUs alike (NCCL cannot put two
    ranks on one device), and the notice names the launch that uses the GPUs instead. Every rank of a node
    decides the same from the same facts; nodes are assumed to have the same number of GPUs.

    Raises:
        SystemExit: ``backend="nccl"`` asked for with fewer devices than ranks; the one-line message on
            the node's local rank 0, a silent exit status 1 on its other ranks (so it is printed once).
    """
    ranks = info.local_world_size
    if backend not in (None, "nccl") or backend is None and device_count == 0:
        return backend or "gloo", None
    if device_count >= ranks:
        return "nccl", None
    fit = _fitting_launch(device_count)
    if backend == "nccl":
        message = (
            f"plait: backend 'nccl' needs a CUDA device per rank, but this node runs {ranks} rank(s) on "
            f"{device_count} device(s); {fit}, or leave the backend unset for CPU ranks (gloo)"
        )
        raise SystemExit(message if info.local_rank == 0 else 1)
    return "gloo", (
        f"plait: {ranks} ranks on this node but {device_count} CUDA device(s): all ranks run on CPU "
        f"(gloo); to train on the GPUs, {fit}"
    )


def _fitting_launch(devices: int) -> str:
    """``launch torchrun --nproc-per-node N ...`` that fits ``devices`` GPUs (the examples' default layout)."""
    if devices == 0:
        return "run on a machine with CUDA devices"
    tp, pp = (2, 2) if devices % 4 == 0 else (2, 1) if devices % 2 == 0 else (1, 1)
    return f"launch torchrun --nproc-per-node {devices} (examples: --tp {tp} --pp {pp})"


def init_distributed(
    backend: str | None = None,
    timeout_s: float | None = None,
    env: dict | None = None,
    device_count: int | None = None,
) -> LaunchInfo:
    """Initialize the default process group from the launcher's environment; return when every rank has
    joined it (so no rank can leave while another is still connecting).

    Args:
        backend: "nccl" or "gloo"; default NCCL when the node has a CUDA device per rank, else gloo with a
            one-line notice on rank 0 (``choose_backend``).
        timeout_s: collective timeout in seconds; a dead or frozen peer raises after this instead of
            hanging. None (default): 600 s until an engine exists; ``plait.initialize`` then applies its
            config's ``comm.startup_timeout_s`` (until the first applied step and during checkpoint I/O)
            and ``comm.timeout_s`` (after it). A value: the script's choice, kept for the whole run (the
            engine's config takes it as both ``comm`` timeouts and logs that once; ``explicit_timeout_s``).
        env: the launcher's variables (default ``os.environ``).
        device_count: CUDA devices on this node (default ``torch.cuda.device_count()``; tests pass it).

    Returns the ``LaunchInfo``. Calling it when a group already exists returns the facts unchanged.
    Under torchrun, an error every rank raises is then printed once, by rank 0 (``rank_errors``).
    """
    info = launch_info(env)
    if dist.is_initialized():
        return info
    count = torch.cuda.device_count() if device_count is None else device_count
    backend, notice = choose_backend(info, count, backend)
    if notice and info.rank == 0:
        print(notice, file=sys.stderr, flush=True)
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
        # NCCL's watchdog aborts a collective that outlives the timeout and ends the process (3: without
        # cleanup, torch's default), so a launcher sees the failure and --max-restarts resumes the job
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    timeout = timedelta(seconds=STARTUP_TIMEOUT_S if timeout_s is None else timeout_s)
    _start_group(backend, info, os.environ if env is None else env, env is None, timeout)
    store = dist.distributed_c10d._get_default_store()
    store.set(
        SCRIPT_TIMEOUT_KEY.format(rank=info.rank),
        "none" if timeout_s is None else repr(float(timeout_s)),
    )
    if info.world_size > 1:  # the last rank to join releases the others
        if store.add("plait/joined", 1) == info.world_size:
            store.set("plait/all_joined", "1")
        store.wait(["plait/all_joined"], timeout)
    report_errors_once(os.environ if env is None else env)
    return info


def _start_group(backend: str, info: LaunchInfo, source, own_env: bool, timeout: timedelta) -> None:
    if info.world_size == 1 and "MASTER_PORT" not in source:
        # one process and no launcher (DeepSpeed's init_distributed in a plain script): an in-memory store,
        # so no port is taken and a later group in the same process can start again
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    attempt = int(source.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if own_env and attempt > 0 and source.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A worker group restarted by ``torchrun --max-restarts`` meets in the elastic agent's store,
        # which still holds the previous attempt's addresses: keep each attempt's keys apart.
        store = dist.TCPStore(
            info.master_addr, info.master_port, info.world_size, is_master=False, timeout=timeout
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"plait/attempt{attempt}", store),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
        )
        return
    # Under torchrun, env:// lets torch reuse the elastic agent's store; elsewhere rank 0 hosts one.
    init_method = (
        "env://"
        if own_env and "RANK" in source and "MASTER_ADDR" in source
        else f"tcp://{info.master_addr}:{info.master_port}"
    )
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
    )


def explicit_timeout_s() -> float | None:
    """The collective timeout this rank's script passed to ``init_distributed(timeout_s=...)`` (seconds),
    or None: no value was passed, no group exists, or plait did not start it."""
    if not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    key = SCRIPT_TIMEOUT_KEY.format(rank=dist.get_rank())
    value = store.get(key).decode() if store.check([key]) else "none"
    return None if value == "none" else float(value)


def leave_at_exit() -> None:
    """Leave the default process group when the interpreter exits, for scripts that never call
    ``destroy_process_group`` (DeepSpeed's examples do not): destroy the groups, then release the GIL
    for 0.1 s, at every exit, whatever its status.

    The pause: gloo's worker threads drop their references to a finished collective's tensors only after
    the waiting Python thread has resumed, and with torch's tensor ownership that drop takes the GIL; a
    worker still doing it when the interpreter finalizes is ended there and the process aborts ("terminate
    called without an active exception", pytorch/pytorch issue 190489) after its work is done (3 of 100
    loaded two-rank runs without the pause, 0 of 100 with it).

    No barrier first: Python does not tell an exit hook the exit status (``sys.exit(1)`` sets neither
    ``sys.last_value`` nor calls ``sys.excepthook``), and a rank that ends early while its peers wait in
    a collective must close its connections at once: in a barrier it would hold them until the timeout
    (180 s at the default). Its peers' collectives then fail within about a second (gloo), or the launcher
    sees the exit and stops them (NCCL, torchrun), as after an uncaught exception. A clean exit needs no
    barrier: every rank finished joining in ``init_distributed``, a rank's gloo collectives have returned
    (closing a socket still delivers what was sent), and NCCL's shutdown lets the rank's queued kernels
    finish first (torch >= 2.5; they complete as the peers reach the same collectives).
    """
    import atexit
    import time

    def teardown() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
            time.sleep(0.1)

    atexit.register(teardown)


def set_collective_timeout(seconds: float, groups=()) -> None:
    """Set the timeout of every later collective on the default process group and on ``groups`` (None
    entries skipped) to ``seconds``: a rank that stops answering (frozen, swapped out, a hung data loader)
    then ends its peers' waits with an error after that long (gloo raises; NCCL's watchdog aborts the
    communicator and ends the process), instead of after the start-up timeout. Uses torch's
    ``distributed_c10d._set_pg_timeout`` (as torchtitan does); a no-op without a process group.
    """
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = timedelta(seconds=seconds)
    for group in {None, *(g for g in groups if g is not None)}:
        _set_pg_timeout(timeout, group)
