"""An error every rank raises is printed once under torchrun, by rank 0; an error of one rank alone is still
printed (``plait.parallel.rank_errors``). Two gloo ranks under ``torch.distributed.run``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.parallel import rank_errors

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
import torch.distributed as dist
from plait.config import ConfigError
from plait.parallel import init_distributed
info = init_distributed()
if sys.argv[1] == "every rank":
    raise ConfigError("zero_optimization.stage must be 0, 1, 2 or 3, got 7")
if info.rank == 1:
    raise ConfigError("rank 1 alone: its data file is missing")
dist.barrier()  # rank 0 waits for rank 1, until rank 1's exit closes its connection
"""
ERROR_LINE = "plait.config.schema_base.ConfigError: "


def torchrun(tmp_path, mode: str) -> tuple[int, list[str]]:
    """Run SCRIPT on 2 ranks; the exit status and the lines naming the ConfigError (as torchrun prints
    them: ``[rankN]: <type>: <message>``)."""
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(script), mode],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout + proc.stderr
    return proc.returncode, [
        ln for ln in out.splitlines() if ERROR_LINE in ln and "raise" not in ln
    ]


def test_an_error_every_rank_raises_is_printed_once_by_rank_0(tmp_path):
    """Without the wait both ranks print it (``PLAIT_ALL_RANK_ERRORS=1`` gave two lines, one per rank)."""
    code, lines = torchrun(tmp_path, "every rank")
    assert code != 0
    assert lines == [f"[rank0]: {ERROR_LINE}zero_optimization.stage must be 0, 1, 2 or 3, got 7"]


def test_an_error_of_one_rank_alone_is_still_printed(tmp_path):
    code, lines = torchrun(tmp_path, "rank 1 only")
    assert code != 0
    assert lines == [f"[rank1]: {ERROR_LINE}rank 1 alone: its data file is missing"]


@pytest.mark.parametrize(
    "env, waits",
    [
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1"}, True),
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, False),  # rank 0 prints at once
        ({"RANK": "1"}, False),  # SLURM / a launcher that does not stop a failed rank's peers
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", rank_errors.ALL_RANKS_ENV: "1"}, False),
    ],
)
def test_which_ranks_hold_their_errors_back(monkeypatch, env, waits):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    rank_errors.report_errors_once(env)
    hook = sys.excepthook
    assert getattr(hook, "plait_waits", False) is waits
    rank_errors.report_errors_once(env)  # idempotent: not wrapped twice
    assert sys.excepthook is hook
