"""pretrain_bert.py, launched as users launch it, on a tiny BERT."""
from __future__ import annotations

from example_launch import metrics, torchrun


def test_pretrain_bert_mlm(tmp_path):
    out = tmp_path / "bert"
    log = torchrun("pretrain_bert.py", 2, "--hidden", "64", "--layers", "2", "--seq-len", "64", "--steps", "30",
                   "--micro-batch", "8", "--global-batch", "16", "--log-every", "10", "--eval-every", "30",
                   "--eval-batches", "1", "--warmup", "3", "--out-dir", str(out), "--no-export")
    assert "tp=2 x pp=1 x cp=1 x dp=1" in log and "AdamW" in log and "samples/s" in log
    _, val, summaries = metrics(out)
    assert val[30] < val[0] - 0.3, f"MLM validation loss {val[0]:.3f} -> {val[30]:.3f}"
    assert summaries[-1]["samples_per_s"] > 0
