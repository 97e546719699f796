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


def word_chain(path, lines: int = 600, run: int = 100) -> None:
    """A text a model can only fill in by reading word order: lines of ``run`` words, each followed by its
    successor in a fixed cycle of the 20 words (a shuffled order), starting anywhere. Every word is in every
    window of 20 or more tokens, so the bag of words around a [MASK] says nothing; its neighbours give it
    away (the left one's successor, the right one's predecessor)."""
    rng = random.Random(0)
    cycle = rng.sample(WORDS, len(WORDS))
    successor = {w: cycle[(i + 1) % len(cycle)] for i, w in enumerate(cycle)}
    text = []
    for _ in range(lines):
        word, line = rng.choice(WORDS), []
        for _ in range(run):
            line.append(word)
            word = successor[word]
        text.append(" ".join(line))
    path.write_text("\n".join(text) + "\n", encoding="utf-8")


def mask_scores(log: str) -> tuple[float, float, str]:
    """(accuracy, unigram baseline accuracy, the baseline's word) from the example's final lines."""
    found = re.search(
        r"masked-token accuracy ([\d.]+)% \(unigram baseline ([\d.]+)%: always '(.+?)'\)", log
    )
    assert found, log[-3000:]
    return float(found.group(1)) / 100, float(found.group(2)) / 100, found.group(3).strip()


def test_pretrain_bert_defaults_learn_word_order(tmp_path):
    """The default recipe (sequence 16, 30% masking, batch 64, Adam beta2 0.98, dp=2) at hidden 64 and 2
    layers, 400 steps, on a text where only word order predicts the masked word (``word_chain``).

    Reading word order is what the bundled corpus's [MASK]s need and what the old defaults did not learn
    there in 1000 steps (6.6% against the unigram baseline's 6.7%); the default run now reaches 20.1%
    against 6.7% (benchmarks/results/pretrain_bert_cpu.md), but only after ~800 steps of the default model,
    beyond a test's budget. Here: measured 34.6% against 4.4% (1,450 [MASK]s). The old recipe (sequence 64,
    15% masking, batch 32, beta2 0.999, tp=2: the old example and config under this test) for the same 400
    steps: at the baseline (4.5% against 4.6%), failing. The accuracy rises ~20 points
    per 100 steps here once the model reads order (16.4% after 300 steps on a similar chain), so we ask
    for >= 15% and 10 points over the baseline: a breakout ~100 steps later than measured still passes; a
    model that does not read word order cannot (binomial standard error ~1.3 points)."""
    data = tmp_path / "chain.txt"
    word_chain(data)
    out = tmp_path / "bert"
    log = torchrun(
        "pretrain_bert.py",
        2,
        *("--hidden", "64", "--layers", "2", "--heads", "2", "--steps", "400"),
        *(
            "--log-every",
            "100",
            "--eval-every",
            "400",
            "--eval-batches",
            "1",
            "--save-every",
            "400",
        ),
        *("--data", str(data), "--val-fraction", "0.1", "--out-dir", str(out)),
    )
    accuracy, baseline, word = mask_scores(log)
    assert word in WORDS and 0.02 < baseline < 0.1, (accuracy, baseline, word)
    assert accuracy >= 0.15 and accuracy >= baseline + 0.1, (accuracy, baseline)
    assert "MLM at sequence 16, tp=1 x pp=1 x cp=1 x dp=2" in log, log[:2000]
    assert "global batch 64 samples" in log


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
        "--tp",
        "2",
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
    accuracy, baseline, word = mask_scores(log)
    assert word in WORDS and 0.02 < baseline < 0.1, (accuracy, baseline, word)
    assert accuracy >= 0.5 and accuracy >= baseline + 0.4, (accuracy, baseline)
    assert re.search(
        r"held-out \[MASK\] tokens \([\d,]+\): loss [\d.]+ nats \(unigram baseline [\d.]+\)", log
    )
    demo = [line for line in log.splitlines() if "[MASK]" in line and "->" in line]
    assert len(demo) == 4 and all(len(re.findall(r"\d+\.\d%", line)) == 3 for line in demo), demo
