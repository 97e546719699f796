"""Launch the example scripts as users launch them (``torchrun`` subprocesses on CPU/gloo) and read
what they write; shared by the tests/test_examples*.py files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS, HALF = 12, 6
# llama family, 2 blocks, hidden 64; global batch 16 of 32 tokens (micro 4 x accumulation 4 / dp).
TINY = [
    "--hidden",
    "64",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--ffn",
    "176",
    "--seq-len",
    "32",
    "--steps",
    str(STEPS),
    "--log-every",
    "1",
    "--eval-every",
    str(HALF),
    "--eval-batches",
    "1",
    "--save-every",
    "100",
    "--warmup",
    "2",
    "--lr",
    "1e-2",
]


def torchrun(
    script: str,
    nproc: int,
    *args: str,
    launcher: tuple = ("--standalone",),
    timeout: float = 240,
    check: bool = True,
    background: bool = False,
):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        "--nproc-per-node",
        str(nproc),
        str(EXAMPLES / script),
        *args,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if background:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    out = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} exited with {proc.returncode}:\n{out[-6000:]}"
        )
    return out


def metrics(out_dir: Path) -> tuple[dict, dict, list]:
    """(train loss by step, val loss by step, summaries); later records win."""
    train, val, summaries = {}, {}, []
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "train":
            train[rec["step"]] = rec["loss"]
        elif rec["type"] == "val":
            val[rec["step"]] = rec["val_loss"]
        else:
            summaries.append(rec)
    return train, val, summaries


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
