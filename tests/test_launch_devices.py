"""``torchrun --nproc-per-node 4`` on a node with fewer CUDA devices than ranks: the ranks run on CPU (gloo)
with one notice naming the launch that fits the GPUs, instead of NCCL's "invalid device ordinal" on every
rank. The device count is passed to ``init_distributed(device_count=...)``, so CPU machines test it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.parallel.launch import choose_backend, launch_info

ROOT = Path(__file__).resolve().parents[1]


def node(ranks: int, local_rank: int = 0):
    return launch_info(
        {
            "RANK": str(local_rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(ranks),
        }
    )


@pytest.mark.parametrize(
    "devices,fit",
    [
        (1, "--nproc-per-node 1 (examples: --tp 1 --pp 1)"),
        (2, "--nproc-per-node 2 (examples: --tp 2 --pp 1)"),
    ],
)
def test_fewer_gpus_than_ranks_falls_back_to_cpu_ranks_with_one_line(devices, fit):
    backend, notice = choose_backend(node(4), devices)
    assert backend == "gloo"
    assert notice == (
        f"plait: 4 ranks on this node but {devices} CUDA device(s): all ranks run on CPU (gloo); "
        f"to train on the GPUs, launch torchrun {fit}"
    )


@pytest.mark.parametrize("devices,backend", [(0, "gloo"), (4, "nccl"), (8, "nccl")])
def test_no_gpu_or_enough_gpus_needs_no_notice(devices, backend):
    assert choose_backend(node(4), devices) == (backend, None)
    assert choose_backend(node(4), devices, "gloo") == ("gloo", None)


def test_asked_for_nccl_without_the_devices_is_refused_once_per_node():
    with pytest.raises(SystemExit) as first:
        choose_backend(node(4, local_rank=0), 1, "nccl")
    assert str(first.value.code).startswith(
        "plait: backend 'nccl' needs a CUDA device per rank, but this node "
        "runs 4 rank(s) on 1 device(s); launch torchrun --nproc-per-node 1"
    )
    with pytest.raises(SystemExit) as other:
        choose_backend(node(4, local_rank=3), 1, "nccl")
    assert other.value.code == 1  # silent: local rank 0 says it


def test_slurm_tasks_per_node_counts_the_node_ranks():
    info = launch_info(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
            "SLURM_NODELIST": "g[1-2]",
        }
    )
    assert info.local_world_size == 4 and choose_backend(info, 2)[0] == "gloo"


SCRIPT = """
import torch.distributed as dist
from plait.parallel import init_distributed
init_distributed(device_count=1)
t = __import__("torch").ones(1)
dist.all_reduce(t)
# one write(2) per line: two ranks share torchrun's stdout pipe, and print() may write the text and the
# newline separately (unbuffered stdout), which interleaves the ranks' lines
__import__("os").write(1, f"rank {dist.get_rank()} backend {dist.get_backend()} sum {t.item():g}\\n".encode())
dist.destroy_process_group()
"""


def test_torchrun_two_ranks_on_one_gpu_run_on_cpu_and_say_it_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 backend gloo sum 2",
        "rank 1 backend gloo sum 2",
    ]
    notices = [line for line in proc.stderr.splitlines() if line.startswith("plait:")]
    assert notices == [
        "plait: 2 ranks on this node but 1 CUDA device(s): all ranks run on CPU (gloo); to train "
        "on the GPUs, launch torchrun --nproc-per-node 1 (examples: --tp 1 --pp 1)"
    ]
