"""Which CPU-sized MLM recipe learns to read the context around a ``[MASK]`` within minutes? One process.

Trains plait's BERT from scratch on the bundled corpus (AdamW, linear warm-up then linear decay, clipping
1.0, BERT's 80/10/10 masking at ``--mask-prob``, output layer on the selected positions only) and prints,
every ``--eval-every`` steps, the top-1 accuracy and loss on the ``[MASK]`` tokens of the first 512
held-out windows (masked at 15% with a fixed seed) against the unigram baseline (the training split's
token frequencies), the elapsed time, and the rms of frequent words' and of the position embeddings.
``--pos-std`` rescales the position embeddings at the start; ``--init-std`` sets every weight's init std.

    python benchmarks/probe_bert_recipe.py --seq-len 32 --mask-prob 0.4 --steps 600

Results: benchmarks/results/pretrain_bert_cpu.md ("The defaults that learn to read the context").
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from plait.data import TokenDataset, bundled_token_file, mask_tokens
from plait.layers import TransformerModel
from plait.models import preset

VOCAB, CLS, SEP, MASK, SPECIAL = 8192, 2, 3, 4, range(6)  # the bundled tokenizer's ids


def frame(x: torch.Tensor) -> torch.Tensor:
    """``[CLS] x [SEP]`` for a ``[batch, seq]`` tensor of ids."""
    b = len(x)
    return torch.cat([torch.full((b, 1), CLS), x, torch.full((b, 1), SEP)], 1)


def held_out(seq_len: int):
    """``(train, masked, labels, (unigram accuracy, loss))`` for the first 512 validation windows, masked at 15%, seed 0."""
    train = TokenDataset(bundled_token_file(), seq_len - 2, "train", 0.02)
    val = TokenDataset(bundled_token_file(), seq_len - 2, "val", 0.02)
    counts = np.bincount(
        np.asarray(train.tokens[train.start : train.stop], np.int64), minlength=VOCAB
    )
    x = frame(torch.stack([val[i][0] for i in range(min(512, len(val)))]))
    masked, labels = mask_tokens(
        x, MASK, VOCAB, SPECIAL, 0.15, generator=torch.Generator().manual_seed(0)
    )
    target = labels[masked == MASK]
    log_freq = np.log(np.maximum(counts, 1) / counts.sum())
    unigram = (
        float((target == int(counts.argmax())).float().mean()),
        float(-log_freq[target].mean()),
    )
    return train, masked, labels, unigram


def accuracy(model, masked, labels) -> tuple[float, float]:
    """Top-1 accuracy and loss (nats) at the ``[MASK]`` positions."""
    model.eval()
    hits = n = 0
    nll = 0.0
    with torch.no_grad():
        for i in range(0, len(masked), 128):
            x, y = masked[i : i + 128], labels[i : i + 128]
            logits = model(input_ids=x, token_type_ids=torch.zeros_like(x))
            where = x == MASK
            hits += int((logits[where].argmax(-1) == y[where]).sum())
            nll += float(
                torch.nn.functional.cross_entropy(logits[where], y[where], reduction="sum")
            )
            n += int(where.sum())
    model.train()
    return hits / n, nll / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    for name, kind, default in [
        ("--lr", float, 2e-3),
        ("--beta2", float, 0.999),
        ("--steps", int, 600),
        ("--warmup", float, 0.1),
        ("--batch", int, 32),
        ("--hidden", int, 128),
        ("--layers", int, 4),
        ("--heads", int, 4),
        ("--seq-len", int, 64),
        ("--mask-prob", float, 0.15),
        ("--eval-every", int, 100),
        ("--threads", int, 2),
        ("--init-std", float, 0.02),
        ("--pos-std", float, 0.0),
    ]:
        p.add_argument(name, type=kind, default=default)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    train, masked, labels, unigram = held_out(args.seq_len)
    arch = preset(
        "bert-tiny",
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_std=args.init_std,
    )
    model = TransformerModel(arch, seed=1)
    if args.pos_std:
        with torch.no_grad():
            pos = model.layers["0"].position_embeddings
            pos.mul_(args.pos_std / pos.std())
    train_model = TransformerModel(arch.replace(head_labeled_only=True), seed=1)
    train_model.load_state_dict(model.state_dict())
    model = train_model
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, args.beta2), eps=1e-6, weight_decay=0.01
    )
    warm = max(1, int(args.steps * args.warmup))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (args.steps - s) / (args.steps - warm)))
    )
    scorer = TransformerModel(arch, seed=1)
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    print(vars(args), f"unigram baseline {unigram[0]:.1%} {unigram[1]:.2f}", flush=True)
    start, window = time.time(), []
    for step in range(1, args.steps + 1):
        x = frame(torch.stack([train[int(i)][0] for i in rng.integers(0, len(train), args.batch)]))
        x, y = mask_tokens(x, MASK, VOCAB, SPECIAL, args.mask_prob, generator=gen)
        loss = model(input_ids=x, labels=y, token_type_ids=torch.zeros_like(x))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        window.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            scorer.load_state_dict(model.state_dict())
            acc, nll = accuracy(scorer, masked, labels)
            print(
                f"step {step} loss {np.mean(window):.3f} [MASK] accuracy {acc:.1%} "
                f"(unigram {unigram[0]:.1%}) loss {nll:.2f} (unigram {unigram[1]:.2f}) "
                f"t {time.time() - start:.0f}s",
                flush=True,
            )
            window = []
            emb = model.layers["0"]
            print(
                f"  rms word (50 most frequent) {emb.word_embeddings.weight[100:150].pow(2).mean().sqrt():.3f}"
                f" position {emb.position_embeddings[: args.seq_len].pow(2).mean().sqrt():.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
