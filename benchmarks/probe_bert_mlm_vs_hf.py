"""Does plait's BERT learn masked-language modelling as transformers' ``BertForMaskedLM`` does?

Trains both from scratch, one process, with the same recipe (AdamW, linear warmup then decay, gradient
clipping 1.0, BERT's 15% masking of the bundled corpus, the same samples and masks per step) and prints
every 20 steps the mean training loss and that step's batch's loss on its ``[MASK]`` tokens alone (what
reading the context lowers). Both score only the masked positions (plait: ``head_labeled_only``;
transformers: ``model.cls`` on the gathered hidden states).

    python benchmarks/probe_bert_mlm_vs_hf.py --impl plait      # then --impl hf; compare the curves

Result (benchmarks/results/pretrain_bert_cpu.md): the two curves agree to ~0.01 at every logged step; over
2400 steps (``--steps 3000``) the ``[MASK]`` loss stays at the unigram level (~6.2).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from plait.data import TokenDataset, bundled_token_file, mask_tokens
from plait.layers import TransformerModel
from plait.models import preset

VOCAB, MASK, SPECIAL = (
    8192,
    4,
    range(6),
)  # bundled tokenizer: [PAD] [UNK] [CLS] [SEP] [MASK] <|endoftext|>


def build(impl: str, args):
    """``(model, loss_of(masked_ids, labels))`` for plait's or transformers' BERT of the same size."""
    heads, drop = args.hidden // 32, args.dropout
    if impl == "plait":
        arch = preset(
            "bert-tiny",
            vocab_size=VOCAB,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=heads,
            hidden_dropout=drop,
            attention_dropout=drop,
            head_labeled_only=True,
        )
        model = TransformerModel(arch, seed=1)
        return model, lambda x, y: model(input_ids=x, labels=y, token_type_ids=torch.zeros_like(x))
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=256,
        hidden_dropout_prob=drop,
        attention_probs_dropout_prob=drop,
    )
    model = BertForMaskedLM(cfg)

    def loss_of(x, y):
        keep = y != -100
        logits = model.cls(model.bert(input_ids=x).last_hidden_state[keep])
        return torch.nn.functional.cross_entropy(logits, y[keep])

    return model, loss_of


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--impl", choices=["plait", "hf"], required=True)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.0)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TokenDataset(bundled_token_file(), args.seq_len - 2, "train", 0.02)
    model, loss_of = build(args.impl, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, eps=1e-6)
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, (args.steps - s) / (args.steps - warm))
    )
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    start, window = time.time(), []
    for step in range(1, args.steps + 1):
        x = torch.stack([data[int(i)][0] for i in rng.integers(0, len(data), args.batch)])
        x = torch.cat(
            [torch.full((args.batch, 1), 2), x, torch.full((args.batch, 1), 3)], 1
        )  # [CLS] .. [SEP]
        masked, labels = mask_tokens(x, MASK, VOCAB, SPECIAL, 0.15, generator=gen)
        loss = loss_of(masked, labels)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        window.append(loss.item())
        if step % 20 == 0:
            with (
                torch.no_grad()
            ):  # this batch's [MASK] tokens alone: what reading the context lowers
                at_mask = loss_of(masked, torch.where(masked == MASK, labels, -100)).item()
            print(
                f"step {step} loss {np.mean(window):.3f} mask-only {at_mask:.3f} t {time.time() - start:.0f}s",
                flush=True,
            )
            window = []


if __name__ == "__main__":
    main()
