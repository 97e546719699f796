"""The example scripts, launched as users launch them (``torchrun`` subprocesses on CPU/gloo), on a
tiny model: pretraining falls in loss, checkpoints resume the same loss curve in the same or another
layout, a two-"node" launch matches one node, a SIGKILLed rank under ``--max-restarts 1`` resumes and
finishes, and BERT, a composed architecture and a transformers model train."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS, HALF = 12, 6
# llama family, 2 blocks, hidden 64; global batch 16 of 32 tokens (micro 4 x accumulation 4 / dp).
TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "176", "--seq-len", "32",
        "--steps", str(STEPS), "--log-every", "1", "--eval-every", str(HALF), "--eval-batches", "1",
        "--save-every", "100", "--warmup", "2", "--lr", "1e-2"]


def torchrun(script: str, nproc: int, *args: str, launcher: tuple = ("--standalone",), timeout: float = 240,
             check: bool = True, background: bool = False):
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc-per-node", str(nproc),
           str(EXAMPLES / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    out = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited with {proc.returncode}:\n{out[-6000:]}")
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
    assert val[STEPS] < val[0] - 1.0, f"validation loss {val[0]:.3f} -> {val[STEPS]:.3f} did not fall by 1 nat"
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{STEPS}"
    assert summaries[-1]["val_loss_end"] == val[STEPS] and summaries[-1]["steps_this_run"] == STEPS
    assert (out / "hf" / "config.json").is_file() and "samples from the exported model" in log
    assert "LlamaForCausalLM" in (out / "hf" / "config.json").read_text()


def test_one_progress_line_per_logged_step_with_elapsed_time_and_eta(full_run):
    """--log-every 1: one line for each of the 12 steps (no DeepSpeed-style ``step=10, skipped=0`` copy from the
    config's steps_per_print), each with the time since the start and an ETA (0 at the last step)."""
    _, log, _ = full_run
    lines = [line for line in log.splitlines() if re.match(r"step +\d+/\d+ \| loss", line)]
    assert [int(re.match(r"step +(\d+)/", line).group(1)) for line in lines] == list(range(1, STEPS + 1))
    assert not [line for line in log.splitlines() if re.search(r"step=\d+, skipped=", line)]
    times = [re.search(r"\| ([\dm.]+s) elapsed, ETA ([\dm.]+s)$", line) for line in lines]
    assert all(times) and times[-1].group(2) == "0.0s", lines[-1]


def test_two_node_launch_matches_one_node_and_resumes_in_another_layout(full_run, tmp_path):
    """Two torchrun launches (--nnodes 2, 2 processes each, c10d rendezvous on 127.0.0.1) train
    tp=2 x pp=2 to step 6 as one node does; then one launch of 2 processes resumes that checkpoint as
    tp=1 x pp=1 x dp=2 with ZeRO-2 and continues the uninterrupted run's losses to 1e-5."""
    _, _, (ref, ref_val, _) = full_run
    out = tmp_path / "run"
    launcher = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                "--rdzv-id", "plait-test")
    args = (*TINY, "--out-dir", str(out), "--stop-at-step", str(HALF), "--no-export")
    nodes = [torchrun("pretrain_gpt.py", 2, *args, launcher=launcher, background=True) for _ in range(2)]
    logs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    train, _, _ = metrics(out)
    assert [train[s] for s in range(1, HALF + 1)] == pytest.approx([ref[s] for s in range(1, HALF + 1)], rel=1e-5)
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{HALF}"

    log = torchrun("pretrain_gpt.py", 2, *TINY, "--out-dir", str(out), "--tp", "1", "--pp", "1",
                   "--zero-stage", "2", "--resume", "--no-export")
    assert "tp=1 x pp=1 x cp=1 x dp=2" in log
    assert f"at step {HALF} (data epoch 0, position {HALF * 16} of" in log      # the data position came back
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
    log = torchrun("pretrain_gpt.py", 4, *TINY, "--out-dir", str(out), "--tp", "1", "--pp", "2", "--cp", "2",
                   "--tile-tokens", "8", "--stop-at-step", str(HALF), "--no-export")
    assert "tp=1 x pp=2 x cp=2 x dp=1" in log
    train, _, _ = metrics(out)
    assert [train[s] for s in range(1, HALF + 1)] == pytest.approx([ref[s] for s in range(1, HALF + 1)], rel=1e-5)
    torchrun("pretrain_gpt.py", 4, *TINY, "--out-dir", str(out), "--tp", "2", "--pp", "2", "--resume", "--no-export")
    train, _, _ = metrics(out)
    assert [train[s] for s in range(HALF + 1, STEPS + 1)] == pytest.approx([ref[s] for s in range(HALF + 1, STEPS + 1)],
                                                                           rel=1e-5)


def test_mixture_of_experts_pretraining_with_expert_parallelism(tmp_path):
    """``--model mixtral-tiny --ep 2`` over pp=2 x dp=2 (4 experts per block, 2 on each ep rank): the loss falls,
    every progress line shows the experts' auxiliary loss and load imbalance (also in metrics.jsonl, where the
    imbalance is at least 1, its least possible value), and the export is a Mixtral that transformers samples."""
    out = tmp_path / "moe"
    log = torchrun("pretrain_gpt.py", 4, *TINY, "--model", "mixtral-tiny", "--tp", "1", "--pp", "2", "--ep", "2",
                   "--out-dir", str(out), "--sample-tokens", "4")
    assert "tp=1 x pp=2 x cp=1 x dp=2" in log and log.count("| moe aux ") == STEPS
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == STEPS and all(r["load_imbalance"] >= 1.0 and r["aux_loss"] > 0 for r in train)
    assert train[-1]["loss"] < train[0]["loss"] - 0.5   # from ln(8192) = 9.0 at lr 1e-2: measured 9.0 -> 7.1
    assert json.loads((out / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]


def test_killed_rank_restarts_from_the_latest_checkpoint(full_run, tmp_path):
    """SIGKILL of rank 1 at step 8 under --max-restarts 1: the job restarts, resumes at step 6, finishes,
    and steps 7-12 equal the uninterrupted run's."""
    _, _, (ref, _, _) = full_run
    out = tmp_path / "run"
    log = torchrun("pretrain_gpt.py", 4, *TINY, "--out-dir", str(out), "--save-every", str(HALF),
                   "--crash-at-step", "8", "--no-export", launcher=("--standalone", "--max-restarts", "1"))
    assert "killing myself with SIGKILL at step 8" in log
    assert f"at step {HALF} (data epoch 0" in log and f"step {STEPS}/{STEPS}" in log
    train, _, _ = metrics(out)
    assert [train[s] for s in range(HALF + 1, STEPS + 1)] == pytest.approx(
        [ref[s] for s in range(HALF + 1, STEPS + 1)], rel=1e-5)


def test_killed_rank_without_restarts_ends_the_job_with_a_clear_error(tmp_path):
    """The same SIGKILL with no restarts allowed: the job exits non-zero, well inside the collective
    timeout (--timeout 60), and torchrun names the dead rank and its signal instead of hanging."""
    import time
    start = time.monotonic()
    log = torchrun("pretrain_gpt.py", 2, *TINY, "--tp", "1", "--pp", "1", "--out-dir", str(tmp_path / "run"),
                   "--crash-at-step", "3", "--no-export", "--timeout", "60", check=False, timeout=200)
    elapsed = time.monotonic() - start
    assert "killing myself with SIGKILL at step 3" in log
    assert "ChildFailedError" in log and "Signal 9 (SIGKILL)" in log, log[-3000:]
    assert f"step {STEPS}/{STEPS}" not in log
    assert elapsed < 150, f"the job took {elapsed:.0f}s to end"


def test_pretrain_gpt_on_user_text_and_pretokenized_npy(tmp_path):
    """--data with a user's text file (tokenized into <out-dir>/data) and with a pre-tokenized .npy."""
    import numpy as np
    from plait.data import load_bundled_text
    text = tmp_path / "mine.txt"
    text.write_text(load_bundled_text()[:200_000], encoding="utf-8")
    out = tmp_path / "text"
    log = torchrun("pretrain_gpt.py", 1, *TINY, "--steps", "2", "--eval-every", "2", "--data", str(text),
                   "--out-dir", str(out), "--no-export")
    assert "step      2/2" in log and list((out / "data").glob("tokens-*.bin"))
    ids = np.random.default_rng(0).integers(0, 8192, size=60_000, dtype=np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    log = torchrun("pretrain_gpt.py", 1, *TINY, "--steps", "2", "--eval-every", "2", "--data",
                   str(tmp_path / "ids.npy"), "--out-dir", str(tmp_path / "npy"), "--no-export")
    assert "step      2/2" in log


def test_plot_metrics_writes_a_png(full_run, tmp_path):
    pytest.importorskip("matplotlib")
    out, _, _ = full_run
    png = tmp_path / "loss.png"
    subprocess.run([sys.executable, str(EXAMPLES / "plot_metrics.py"), str(out / "metrics.jsonl"), str(png)],
                   check=True, capture_output=True, timeout=120)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_pretrain_bert_mlm(tmp_path):
    out = tmp_path / "bert"
    log = torchrun("pretrain_bert.py", 2, "--hidden", "64", "--layers", "2", "--seq-len", "64", "--steps", "30",
                   "--micro-batch", "8", "--global-batch", "16", "--log-every", "10", "--eval-every", "30",
                   "--eval-batches", "1", "--warmup", "3", "--out-dir", str(out), "--no-export")
    assert "tp=2 x pp=1 x cp=1 x dp=1" in log and "AdamW" in log and "samples/s" in log
    _, val, summaries = metrics(out)
    assert val[30] < val[0] - 0.3, f"MLM validation loss {val[0]:.3f} -> {val[30]:.3f}"
    assert summaries[-1]["samples_per_s"] > 0


def test_compose_model_trains_over_tp_and_pp(tmp_path):
    out = tmp_path / "compose"
    log = torchrun("compose_model.py", 4, "--layers", "4", "--hidden", "64", "--seq-len", "32", "--steps", "10",
                   "--eval-every", "10", "--eval-batches", "1", "--log-every", "5", "--warmup", "2",
                   "--sequence-parallel", "--out-dir", str(out))
    assert "['parallel', 'sequential', 'parallel', 'sequential']" in log and "tp=2 x pp=2" in log
    _, val, _ = metrics(out)
    assert val[10] < val[0] - 0.5, f"validation loss {val[0]:.3f} -> {val[10]:.3f}"


def test_finetune_hf_zero3_on_a_transformers_model(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    log = torchrun("finetune_hf.py", 2, "--steps", "8", "--log-every", "4", "--offload", "optimizer",
                   "--out-dir", str(out))
    assert "GPT2LMHeadModel" in log and "ZeRO-3 + offload optimizer" in log and "dp=2" in log
    steps = [line.split("|")[0].strip() for line in log.splitlines() if line.startswith("step")]
    assert steps == ["step    1/8", "step    4/8", "step    8/8"] and "elapsed, ETA 0.0s" in log   # one line each
    losses = json.loads((out / "losses.json").read_text())
    assert losses[-1] < losses[0] - 0.3, losses
    assert (out / "checkpoints" / "latest").is_file()
