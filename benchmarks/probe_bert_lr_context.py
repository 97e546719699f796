"""Can a from-scratch BERT learn to read its context at a given AdamW learning rate? A toy check, one process.

Each sample is 64 tokens of one word (20 words) framed as [CLS] ... [SEP], masked as BERT does (15%; 80/10/10):
every visible neighbour of a [MASK] is the answer, so a model that reads the context scores 100% top-1 and
one that does not scores ~1/20. transformers' BertForMaskedLM (hidden 64, 2 layers, 2 heads, no dropout),
batch 16, warm-up 6 steps then linear decay, clipping 1.0; prints the step's loss and the [MASK] accuracy on
256 held-out samples every 20 steps.

    python benchmarks/probe_bert_lr_context.py 2e-3 200     # lr, steps

Result (benchmarks/results/pretrain_bert_cpu.md, runs of 200 steps): 100% by step 100 at 2e-3, 94% by step 160 at 1e-3, 18%
at step 200 at 5e-4, and 4-7% (chance) through step 100 at 1e-2.
"""

import sys

import torch
from transformers import BertConfig, BertForMaskedLM

from plait.data import mask_tokens

torch.manual_seed(0)
torch.set_num_threads(1)
lr, steps = float(sys.argv[1]), int(sys.argv[2])
V = 8192
words = torch.arange(100, 120)
cfg = BertConfig(
    vocab_size=V,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=256,
    hidden_dropout_prob=0,
    attention_probs_dropout_prob=0,
    max_position_embeddings=256,
)
m = BertForMaskedLM(cfg)
opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01, eps=1e-6)


def batch(n, g):
    w = words[torch.randint(20, (n,), generator=g)]
    x = w[:, None].expand(n, 64).clone()
    x[:, 0] = 2
    x[:, -1] = 3
    return mask_tokens(x, 4, V, range(6), 0.15, generator=g)


g = torch.Generator().manual_seed(0)
vm, vl = batch(256, torch.Generator().manual_seed(1))
vl = torch.where(vm == 4, vl, -100)
for s in range(1, steps + 1):
    x, y = batch(16, g)
    lr_s = lr * min(1, s / 6) * (1 - s / (steps + 1))
    for pg in opt.param_groups:
        pg["lr"] = lr_s
    loss = m(input_ids=x, labels=y).loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    if s % 20 == 0:
        with torch.no_grad():
            lg = m(input_ids=vm).logits
            k = vl != -100
            print(
                s,
                round(loss.item(), 3),
                "acc",
                (lg[k].argmax(-1) == vl[k]).float().mean().item(),
                flush=True,
            )
