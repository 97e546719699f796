"""A BERT's masked-LM loss on the bundled corpus's validation split, by kind of scored token.

BERT's masking scores three kinds of token (Devlin et al. 2019, Sec. 3.1): ``[MASK]`` (80%), unchanged
(10%) and randomly replaced (10%). A model can lower the loss on the last two by copying the visible token,
without reading the context; only the ``[MASK]`` loss shows how much of the context it reads.

    python benchmarks/probe_bert_mlm_kinds.py runs/pretrain_bert/hf     # the folder pretrain_bert.py exports

Result (benchmarks/results/pretrain_bert_cpu.md): after the CPU defaults, [MASK] 6.49, unchanged 1.59,
random 6.78 nats.
"""

from __future__ import annotations

import sys

import torch
from transformers import BertForMaskedLM

from plait.data import TokenDataset, bundled_token_file, mask_tokens

CLS, SEP, MASK, VOCAB, SPECIAL = 2, 3, 4, 8192, range(6)  # the bundled tokenizer's ids


def main(hf_dir: str, seq_len: int = 64) -> None:
    torch.set_num_threads(1)
    model = BertForMaskedLM.from_pretrained(hf_dir).eval()
    val = TokenDataset(bundled_token_file(), seq_len - 2, "val", 0.02)
    x = torch.stack([val[i][0] for i in range(len(val))])
    x = torch.cat([torch.full((len(x), 1), CLS), x, torch.full((len(x), 1), SEP)], 1)
    masked, labels = mask_tokens(
        x, MASK, VOCAB, SPECIAL, 0.15, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logp = torch.cat(
            [
                model(input_ids=masked[i : i + 64]).logits.log_softmax(-1)
                for i in range(0, len(x), 64)
            ]
        )
    scored = labels != -100
    nll = -logp[scored].gather(-1, labels[scored][:, None])[:, 0]
    seen, target = masked[scored], labels[scored]
    kinds = {
        "[MASK]": seen == MASK,
        "unchanged": seen == target,
        "random": (seen != MASK) & (seen != target),
    }
    print(f"all scored: {nll.mean():.3f} nats over {int(scored.sum())} tokens")
    for name, where in kinds.items():
        print(f"{name:10s} {nll[where].mean():.3f} nats ({where.float().mean():.1%})")


if __name__ == "__main__":
    main(sys.argv[1])
