"""pretrain_bert.py, launched as users launch it, on a tiny BERT."""

from __future__ import annotations

import random
import re

from example_launch import metrics, torchrun

# Single-token words of the bundled tokenizer (with a leading space).
WORDS = [
    "king",
    "land",
    "house",
    "water",
    "fire",
    "gold",
    "silver",
    "bread",
    "wine",
    "sheep",
    "city",
    "gate",
    "river",
    "stone",
    "tree",
    "camel",
    "horse",
    "field",
    "sword",
    "tent",
]


def word_runs(path, cycles: int = 30, run: int = 100) -> None:
    """A text a model can only fill in by reading the context: lines of one word repeated ``run`` times, each
    of the 20 words once per cycle in a shuffled order, so every word is ~1/20 of the held-out tokens."""
    rng, lines = random.Random(0), []
    for _ in range(cycles):
        lines += [" ".join([w] * run) for w in rng.sample(WORDS, len(WORDS))]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_pretrain_bert_mlm_reads_the_context(tmp_path):
    """tp=2, 150 steps of 16 samples on word runs, then export, held-out [MASK] scores and the fill-mask demo.

    Margin: a model that ignores the context answers one word at every [MASK], so it scores that word's
    share of the held-out [MASK]s, ~1/20 here (the printed unigram baseline is such a model). Every visible
    token around a [MASK] is (but at a line's end) the masked word, so a model that reads them scores near
    100% once it has learnt to: measured 79.9% after 150 steps (55.6% after 100; baseline 4.8%, 711 [MASK]s).
    With the labels shuffled within each batch nothing in the context predicts them: measured 3.7% (100 steps), failing.
    We ask for accuracy >= 50% and 40 points over the baseline (a binomial standard error here is < 2 points)."""
    data = tmp_path / "words.txt"
    word_runs(data)
    out = tmp_path / "bert"
    log = torchrun(
        "pretrain_bert.py",
        2,
        "--hidden",
        "64",
        "--layers",
        "2",
        "--seq-len",
        "64",
        "--steps",
        "150",
        "--micro-batch",
        "8",
        "--global-batch",
        "16",
        "--log-every",
        "50",
        "--eval-every",
        "150",
        "--eval-batches",
        "1",
        "--warmup",
        "6",
        "--data",
        str(data),
        "--val-fraction",
        "0.1",
        "--out-dir",
        str(out),
    )
    assert "tp=2 x pp=1 x cp=1 x dp=1" in log and "AdamW" in log and "samples/s" in log
    _, val, summaries = metrics(out)
    assert val[150] < val[0] - 3.0, f"MLM validation loss {val[0]:.3f} -> {val[150]:.3f}"
    assert summaries[-1]["samples_per_s"] > 0
    found = re.search(
        r"masked-token accuracy ([\d.]+)% \(unigram baseline ([\d.]+)%: always '(.+?)'\)", log
    )
    assert found, log[-3000:]
    accuracy, baseline = float(found.group(1)) / 100, float(found.group(2)) / 100
    assert found.group(3).strip() in WORDS and 0.02 < baseline < 0.1, found.group(0)
    assert accuracy >= 0.5 and accuracy >= baseline + 0.4, found.group(0)
    assert re.search(
        r"held-out \[MASK\] tokens \([\d,]+\): loss [\d.]+ nats \(unigram baseline [\d.]+\)", log
    )
    demo = [line for line in log.splitlines() if "[MASK]" in line and "->" in line]
    assert len(demo) == 4 and all(len(re.findall(r"\d+\.\d%", line)) == 3 for line in demo), demo
