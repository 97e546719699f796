"""The other example scripts: compose_model.py (a composed architecture over tp and pp) and finetune_hf.py
(ZeRO-3 on a transformers model)."""

from __future__ import annotations

import json

import pytest
from example_launch import metrics, torchrun


def test_compose_model_trains_over_tp_and_pp(tmp_path):
    out = tmp_path / "compose"
    log = torchrun(
        "compose_model.py",
        4,
        "--layers",
        "4",
        "--hidden",
        "64",
        "--seq-len",
        "32",
        "--steps",
        "10",
        "--eval-every",
        "10",
        "--eval-batches",
        "1",
        "--log-every",
        "5",
        "--warmup",
        "2",
        "--sequence-parallel",
        "--out-dir",
        str(out),
    )
    assert "['parallel', 'sequential', 'parallel', 'sequential']" in log and "tp=2 x pp=2" in log
    _, val, _ = metrics(out)
    assert val[10] < val[0] - 0.5, f"validation loss {val[0]:.3f} -> {val[10]:.3f}"


def test_finetune_hf_zero3_on_a_transformers_model(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    log = torchrun(
        "finetune_hf.py",
        2,
        "--steps",
        "8",
        "--log-every",
        "4",
        "--offload",
        "optimizer",
        "--out-dir",
        str(out),
    )
    assert "GPT2LMHeadModel" in log and "ZeRO-3 + offload optimizer" in log and "dp=2" in log
    steps = [line.split("|")[0].strip() for line in log.splitlines() if line.startswith("step")]
    assert (
        steps == ["step    1/8", "step    4/8", "step    8/8"] and "elapsed, ETA 0.0s" in log
    )  # one line each
    losses = json.loads((out / "losses.json").read_text())
    assert losses[-1] < losses[0] - 0.3, losses
    assert (out / "checkpoints" / "latest").is_file()
