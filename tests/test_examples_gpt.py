"""pretrain_gpt.py runs that need no reference run: mixture of experts over expert parallelism, a killed
rank without restarts, and user-supplied text or pre-tokenized data."""

from __future__ import annotations

import json

from example_launch import STEPS, TINY, torchrun


def test_mixture_of_experts_pretraining_with_expert_parallelism(tmp_path):
    """``--model mixtral-tiny --ep 2`` over pp=2 x dp=2 (4 experts per block, 2 on each ep rank): the loss falls,
    every progress line shows the experts' auxiliary loss and load imbalance (also in metrics.jsonl, where the
    imbalance is at least 1, its least possible value), and the export is a Mixtral that transformers samples."""
    out = tmp_path / "moe"
    log = torchrun(
        "pretrain_gpt.py",
        4,
        *TINY,
        "--model",
        "mixtral-tiny",
        "--tp",
        "1",
        "--pp",
        "2",
        "--ep",
        "2",
        "--out-dir",
        str(out),
        "--sample-tokens",
        "4",
    )
    assert "tp=1 x pp=2 x cp=1 x dp=2" in log and log.count("| moe aux ") == STEPS
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == STEPS and all(
        r["load_imbalance"] >= 1.0 and r["aux_loss"] > 0 for r in train
    )
    assert (
        train[-1]["loss"] < train[0]["loss"] - 0.5
    )  # from ln(8192) = 9.0 at lr 1e-2: measured 9.0 -> 7.1
    assert json.loads((out / "hf" / "config.json").read_text())["architectures"] == [
        "MixtralForCausalLM"
    ]


def test_killed_rank_without_restarts_ends_the_job_with_a_clear_error(tmp_path):
    """The same SIGKILL with no restarts allowed: the job exits non-zero, well inside the collective
    timeout (--timeout 60), and torchrun names the dead rank and its signal instead of hanging."""
    import time

    start = time.monotonic()
    log = torchrun(
        "pretrain_gpt.py",
        2,
        *TINY,
        "--tp",
        "1",
        "--pp",
        "1",
        "--out-dir",
        str(tmp_path / "run"),
        "--crash-at-step",
        "3",
        "--no-export",
        "--timeout",
        "60",
        check=False,
        timeout=200,
    )
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
    log = torchrun(
        "pretrain_gpt.py",
        1,
        *TINY,
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--data",
        str(text),
        "--out-dir",
        str(out),
        "--no-export",
    )
    assert "step      2/2" in log and list((out / "data").glob("tokens-*.bin"))
    ids = np.random.default_rng(0).integers(0, 8192, size=60_000, dtype=np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    log = torchrun(
        "pretrain_gpt.py",
        1,
        *TINY,
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--data",
        str(tmp_path / "ids.npy"),
        "--out-dir",
        str(tmp_path / "npy"),
        "--no-export",
    )
    assert "step      2/2" in log
