"""pretrain_gpt.py's reference run (tp=2 x pp=2, a module fixture) and what is compared with it, on a tiny
model: pretraining falls in loss, checkpoints resume the same loss curve in the same or another layout,
a two-"node" launch and a context-parallel run match it, a SIGKILLed rank under ``--max-restarts 1``
resumes and finishes, and its metrics plot."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from example_launch import EXAMPLES, HALF, STEPS, TINY, free_port, metrics, torchrun


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The reference: tp=2 x pp=2 (4 processes), 12 steps, exported to Hugging Face and sampled."""
    out = tmp_path_factory.mktemp("full")
    log = torchrun("pretrain_gpt.py", 4, *TINY, "--out-dir", str(out), "--sample-tokens", "8")
    return out, log, metrics(out)


def test_pretrain_gpt_tp2_pp2_trains_checkpoints_exports(full_run):
    out, log, (train, val, summaries) = full_run
    assert "tp=2 x pp=2 x cp=1 x dp=1" in log
    assert sorted(train) == list(range(1, STEPS + 1))
    assert val[STEPS] < val[0] - 1.0, (
        f"validation loss {val[0]:.3f} -> {val[STEPS]:.3f} did not fall by 1 nat"
    )
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{STEPS}"
    assert summaries[-1]["val_loss_end"] == val[STEPS] and summaries[-1]["steps_this_run"] == STEPS
    assert (out / "hf" / "config.json").is_file() and "samples from the exported model" in log
    assert "LlamaForCausalLM" in (out / "hf" / "config.json").read_text()


def test_one_progress_line_per_logged_step_with_elapsed_time_and_eta(full_run):
    """--log-every 1: one line for each of the 12 steps (no DeepSpeed-style ``step=10, skipped=0`` copy from the
    config's steps_per_print), each with the time since the start and an ETA (0 at the last step)."""
    _, log, _ = full_run
    lines = [line for line in log.splitlines() if re.match(r"step +\d+/\d+ \| loss", line)]
    assert [int(re.match(r"step +(\d+)/", line).group(1)) for line in lines] == list(
        range(1, STEPS + 1)
    )
    assert not [line for line in log.splitlines() if re.search(r"step=\d+, skipped=", line)]
    times = [re.search(r"\| ([\dm.]+s) elapsed, ETA ([\dm.]+s)$", line) for line in lines]
    assert all(times) and times[-1].group(2) == "0.0s", lines[-1]


def test_two_node_launch_matches_one_node_and_resumes_in_another_layout(full_run, tmp_path):
    """Two torchrun launches (--nnodes 2, 2 processes each, c10d rendezvous on 127.0.0.1) train
    tp=2 x pp=2 to step 6 as one node does; then one launch of 2 processes resumes that checkpoint as
    tp=1 x pp=1 x dp=2 with ZeRO-2 and continues the uninterrupted run's losses to 1e-5."""
    _, _, (ref, ref_val, _) = full_run
    out = tmp_path / "run"
    launcher = (
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "plait-test",
    )
    args = (*TINY, "--out-dir", str(out), "--stop-at-step", str(HALF), "--no-export")
    nodes = [
        torchrun("pretrain_gpt.py", 2, *args, launcher=launcher, background=True) for _ in range(2)
    ]
    logs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    train, _, _ = metrics(out)
    assert [train[s] for s in range(1, HALF + 1)] == pytest.approx(
        [ref[s] for s in range(1, HALF + 1)], rel=1e-5
    )
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{HALF}"

    log = torchrun(
        "pretrain_gpt.py",
        2,
        *TINY,
        "--out-dir",
        str(out),
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero-stage",
        "2",
        "--resume",
        "--no-export",
    )
    assert "tp=1 x pp=1 x cp=1 x dp=2" in log
    assert (
        f"at step {HALF} (data epoch 0, position {HALF * 16} of" in log
    )  # the data position came back
    train, val, _ = metrics(out)
    resumed = [train[s] for s in range(HALF + 1, STEPS + 1)]
    assert resumed == pytest.approx([ref[s] for s in range(HALF + 1, STEPS + 1)], rel=1e-5)
    assert val[STEPS] == pytest.approx(ref_val[STEPS], rel=1e-5)


def test_context_parallel_run_matches_the_tp_run(full_run, tmp_path):
    """``--cp 2`` with pp=2 (4 processes; each sequence of 32 tokens split over 2 ranks, ring attention) and
    the loss and MLP in tiles of 8 positions trains the tp=2 x pp=2 run's loss curve (same global batch) to
    1e-5: the sequence split changes only the order of float32 sums. Its checkpoint resumes as tp=2 x pp=2 and
    continues that run's curve."""
    _, _, (ref, _, _) = full_run
    out = tmp_path / "cp"
    log = torchrun(
        "pretrain_gpt.py",
        4,
        *TINY,
        "--out-dir",
        str(out),
        "--tp",
        "1",
        "--pp",
        "2",
        "--cp",
        "2",
        "--tile-tokens",
        "8",
        "--stop-at-step",
        str(HALF),
        "--no-export",
    )
    assert "tp=1 x pp=2 x cp=2 x dp=1" in log
    train, _, _ = metrics(out)
    assert [train[s] for s in range(1, HALF + 1)] == pytest.approx(
        [ref[s] for s in range(1, HALF + 1)], rel=1e-5
    )
    torchrun(
        "pretrain_gpt.py",
        4,
        *TINY,
        "--out-dir",
        str(out),
        "--tp",
        "2",
        "--pp",
        "2",
        "--resume",
        "--no-export",
    )
    train, _, _ = metrics(out)
    assert [train[s] for s in range(HALF + 1, STEPS + 1)] == pytest.approx(
        [ref[s] for s in range(HALF + 1, STEPS + 1)], rel=1e-5
    )


def test_killed_rank_restarts_from_the_latest_checkpoint(full_run, tmp_path):
    """SIGKILL of rank 1 at step 8 under --max-restarts 1: the job restarts, resumes at step 6, finishes,
    and steps 7-12 equal the uninterrupted run's."""
    _, _, (ref, _, _) = full_run
    out = tmp_path / "run"
    log = torchrun(
        "pretrain_gpt.py",
        4,
        *TINY,
        "--out-dir",
        str(out),
        "--save-every",
        str(HALF),
        "--crash-at-step",
        "8",
        "--no-export",
        launcher=("--standalone", "--max-restarts", "1"),
    )
    assert "killing myself with SIGKILL at step 8" in log
    assert f"at step {HALF} (data epoch 0" in log and f"step {STEPS}/{STEPS}" in log
    train, _, _ = metrics(out)
    assert [train[s] for s in range(HALF + 1, STEPS + 1)] == pytest.approx(
        [ref[s] for s in range(HALF + 1, STEPS + 1)], rel=1e-5
    )


def test_plot_metrics_writes_a_png(full_run, tmp_path):
    pytest.importorskip("matplotlib")
    out, _, _ = full_run
    png = tmp_path / "loss.png"
    subprocess.run(
        [sys.executable, str(EXAMPLES / "plot_metrics.py"), str(out / "metrics.jsonl"), str(png)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
