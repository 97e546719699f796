"""BERT masked-language-model pretraining (AdamW, linear warmup then decay) on the bundled corpus,
with any tp x pp x ZeRO layout.

    torchrun --nproc-per-node 2 examples/pretrain_bert.py      # CPU: dp=2, about 5 min on 2 busy cores
    python examples/pretrain_bert.py                            # one CPU rank: 2 micro-batches of 32 a step
    torchrun --nproc-per-node 8 examples/pretrain_bert.py --model bert-base --tp 1 --pp 1 --seq-len 128 \\
        --config examples/configs/pretrain_bert_lamb.json --dropout 0.1 --mask-prob 0.15 \\
        --micro-batch 64 --global-batch 4096 --steps 2000              # dp=8 on GPUs, LAMB as in DeepSpeed's tutorial

Samples are 14-token windows of the corpus framed as ``[CLS] ... [SEP]`` (``--seq-len`` 16); 30% of the
other tokens are selected for prediction (``--mask-prob``; 80% of them become ``[MASK]``, 10% a random
token, 10% stay, as BERT does: Devlin et al. 2019, Sec. 3.1), and only those positions go through the
output layer (``head_labeled_only``). The masks are drawn from a seed made of (seed, epoch, data position,
dp rank), so a resumed run masks exactly as the uninterrupted one. Progress lines report samples/s;
``--config`` (default examples/configs/pretrain_bert.json: AdamW 2e-3 with beta2 0.98, WarmupDecayLR,
global batch 64, tp 1 and pp 1 so that the ranks share the data) plus the flags set the rest, as in
pretrain_gpt.py. At the end the checkpoint is exported as ``BertForMaskedLM``, which is scored on the
held-out split's ``[MASK]`` tokens against the unigram baseline (the training split's token frequencies:
"masked-token accuracy 20.1% (unigram baseline 6.7%: always ','"), and fills in the masked word of a few
sentences written in the corpus's style (top-3 with probabilities: "Then Yahweh [MASK] to Moses" ->
' said').

The defaults are sized for minutes on a CPU (benchmarks/results/pretrain_bert_cpu.md). An MLM first
learns the corpus's token frequencies (loss ~6.2), then to copy the visible scored tokens, and only then
to read the words next to a ``[MASK]``, which takes attention heads that look at fixed neighbours. Short
windows (16 tokens: a verse is ~30) and 30% masking (Wettig et al. 2023, "Should You Mask 15% in Masked
Language Modeling?") bring that third stage to ~800 steps of 64 samples; the former defaults (64 tokens,
15%, batch 32, beta2 0.999) stayed at the baseline for 1000 steps. For long runs on real data use longer
sequences, 15% masking and BERT's dropout 0.1. LAMB (pretrain_bert_lamb.json) moves each weight tensor by
lr x its norm per step: at lr 1e-2 and BERT's 0.02 init that is ~2e-4 per weight, as Adam does at 2e-4.
It is made for batches of thousands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrain_common as common
import pretrain_layout as layout
import train_loop

from plait.data import (
    DistributedBatches,
    TokenDataset,
    bundled_data_dir,
    bundled_tokenizer_path,
    mask_tokens,
)
from plait.models import preset

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<|endoftext|>")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    m = parser.add_argument_group("model and data")
    m.add_argument("--model", default="bert-tiny", help="preset: bert-tiny, bert-base")
    m.add_argument("--hidden", type=int)
    m.add_argument("--layers", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument(
        "--seq-len", type=int, default=16, help="tokens per sample including [CLS] and [SEP]"
    )
    m.add_argument(
        "--mask-prob",
        type=float,
        default=0.3,
        help="share of tokens selected for prediction (BERT's 0.15; 0.3 learns faster in minutes)",
    )
    m.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="hidden and attention dropout (BERT's 0.1 slows a run of minutes; for long runs use 0.1)",
    )
    m.add_argument(
        "--data",
        nargs="+",
        help="text files or one pre-tokenized .npy/.bin (default: bundled corpus)",
    )
    m.add_argument(
        "--tokenizer", help="tokenizer.json with [CLS], [SEP], [MASK] (default: the bundled one)"
    )
    m.add_argument("--val-fraction", type=float, default=0.02)
    m.add_argument("--no-export", action="store_true")
    layout.add_parallel_args(parser, "pretrain_bert.json")
    parser.set_defaults(steps=1500, eval_every=250, log_every=100)
    return parser.parse_args(argv)


class MLMBatch:
    """Frame a ``DistributedBatches`` micro-batch as ``[CLS] ids [SEP]`` and mask it for MLM.

    The mask seed is (seed, epoch, position, dp rank) of the loader right after the fetch: the same on
    the tp/pp ranks of one replica, different between replicas, identical after a resume."""

    def __init__(
        self, batches, ids: dict, vocab: int, prob: float, seed: int, dp_rank: int, device
    ):
        self.batches, self.ids, self.vocab, self.prob = batches, ids, vocab, prob
        self.seed, self.dp_rank, self.device = seed, dp_rank, device

    def __call__(self, batch: dict) -> dict:
        x = batch["input_ids"]
        b = x.shape[0]
        x = torch.cat(
            [torch.full((b, 1), self.ids["[CLS]"]), x, torch.full((b, 1), self.ids["[SEP]"])], dim=1
        )
        s = self.batches.state_dict()
        seed = int(
            np.random.SeedSequence(
                [self.seed, s["epoch"], s["position"], self.dp_rank]
            ).generate_state(1)[0]
        )
        masked, labels = mask_tokens(
            x,
            self.ids["[MASK]"],
            self.vocab,
            self.ids.values(),
            self.prob,
            generator=torch.Generator().manual_seed(seed),
        )
        out = {"input_ids": masked, "labels": labels, "token_type_ids": torch.zeros_like(masked)}
        return {k: v.to(self.device, non_blocking=True) for k, v in out.items()}


# Written for the demo in the corpus's style (the World English Bible), not taken from it: the masked word
# follows from the words around it.
DEMO = (
    "Then Yahweh [MASK] to Moses, “Speak to the children of Israel.”",
    "The children of [MASK] went out of the land of Egypt.",
    "The cat sat [MASK] the mat.",
    "He went up [MASK] Jerusalem with his sons and his daughters.",
)


def masked_token_scores(
    model, train: TokenDataset, val: TokenDataset, ids: dict, vocab: int, prob: float, seed: int
) -> dict:
    """Top-1 accuracy and loss (nats) of ``model`` (``BertForMaskedLM``) at the ``[MASK]`` positions of the
    held-out split (its first 2048 samples), masked as in training with a fixed seed, against the unigram
    baseline: the training split's token frequencies (accuracy: always its most frequent token; loss: their
    cross-entropy).

    Only ``[MASK]`` positions count: the 10% unchanged tokens can be copied and the 10% random ones are
    noise; a ``[MASK]`` is guessed from its context alone. Returns a dict of floats and ``n`` (positions)."""
    counts = np.bincount(
        np.asarray(train.tokens[train.start : train.stop], dtype=np.int64), minlength=vocab
    )
    log_freq = torch.from_numpy(np.log(np.maximum(counts, 1) / counts.sum()))
    x = torch.from_numpy(
        np.stack([val.window(i)[:-1] for i in range(min(len(val), 2048))]).astype(np.int64)
    )
    b = len(x)
    x = torch.cat([torch.full((b, 1), ids["[CLS]"]), x, torch.full((b, 1), ids["[SEP]"])], dim=1)
    masked, labels = mask_tokens(
        x, ids["[MASK]"], vocab, ids.values(), prob, generator=torch.Generator().manual_seed(seed)
    )
    hits, nll, n = 0, 0.0, 0
    with torch.no_grad():
        for i in range(0, b, 64):
            where = masked[i : i + 64] == ids["[MASK]"]
            logits = model(input_ids=masked[i : i + 64]).logits[where][:, :vocab].float()
            target = labels[i : i + 64][where]
            hits += int((logits.argmax(-1) == target).sum())
            nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            n += len(target)
    target = labels[masked == ids["[MASK]"]]
    return {
        "n": n,
        "accuracy": hits / n,
        "loss": nll / n,
        "top_token": int(log_freq.argmax()),
        "unigram_accuracy": float((target == log_freq.argmax()).float().mean()),
        "unigram_loss": float(-log_freq[target].mean()),
    }


def fill_mask_demo(model, tok, ids: dict) -> None:
    """Print the top-3 words and their probabilities for each ``DEMO`` sentence's ``[MASK]``."""
    for sentence in DEMO:
        before, after = sentence.split(" [MASK]")
        seq = [
            ids["[CLS]"],
            *tok.encode(before).ids,
            ids["[MASK]"],
            *tok.encode(after).ids,
            ids["[SEP]"],
        ]
        with torch.no_grad():
            probs = (
                model(input_ids=torch.tensor([seq])).logits[0, seq.index(ids["[MASK]"])].softmax(-1)
            )
        top = probs.topk(3)
        guesses = ", ".join(
            f"{tok.decode([t])!r} {p:.1%}"
            for p, t in zip(top.values.tolist(), top.indices.tolist())
        )
        print(f"  {sentence}  ->  {guesses}")


def export_and_evaluate(ckpt_dir: Path, out_dir: Path, tok, ids: dict, data: tuple, args) -> None:
    """Rank 0: export to Hugging Face ``BertForMaskedLM``, score the held-out ``[MASK]`` tokens, fill masks."""
    from plait.checkpoint.convert import to_hf

    hf_dir = out_dir / "hf"
    to_hf(str(ckpt_dir), str(hf_dir), overwrite=True, tokenizer_from=str(bundled_data_dir()))
    print(f"exported to {hf_dir}")
    try:
        from transformers import BertForMaskedLM
    except ImportError as err:
        print(f"not evaluating: {err} (pip install transformers)")
        return
    model = BertForMaskedLM.from_pretrained(str(hf_dir)).eval()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    s = masked_token_scores(model, *data, ids, vocab, args.mask_prob, args.seed)
    top = tok.decode([s["top_token"]])
    print(
        f"held-out [MASK] tokens ({s['n']:,}): loss {s['loss']:.2f} nats (unigram baseline {s['unigram_loss']:.2f})"
    )
    print(
        f"masked-token accuracy {s['accuracy']:.1%} (unigram baseline {s['unigram_accuracy']:.1%}: "
        f"always {top!r})"
    )
    print("fill-mask, top-3 guesses with probabilities:")
    fill_mask_demo(model, tok, ids)


def main(argv=None) -> None:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    ckpt_dir = out_dir / "checkpoints"
    from tokenizers import Tokenizer

    tokenizer_path = Path(args.tokenizer) if args.tokenizer else bundled_tokenizer_path()
    tok = Tokenizer.from_file(str(tokenizer_path))
    ids = {t: tok.token_to_id(t) for t in SPECIAL if tok.token_to_id(t) is not None}
    missing = [t for t in ("[CLS]", "[SEP]", "[MASK]") if t not in ids]
    if missing:
        raise SystemExit(
            f"tokenizer {tokenizer_path} has no {missing}; BERT pretraining needs [CLS], [SEP], [MASK]"
        )
    vocab = tok.get_vocab_size(with_added_tokens=True)
    flags = {
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "num_heads": args.heads,
        "hidden_dropout": args.dropout,
        "attention_dropout": args.dropout,
    }
    arch = preset(args.model, vocab_size=vocab, **{k: v for k, v in flags.items() if v is not None})
    if arch.arch != "bert":
        raise SystemExit(
            f"--model {args.model} is not a BERT preset; use examples/pretrain_gpt.py for decoders"
        )
    if arch.max_position_embeddings < args.seq_len:
        arch = arch.replace(max_position_embeddings=args.seq_len)
    info, mesh, cfg, _ = layout.setup(args, arch.hidden_size)
    # score only the masked positions (~1/6 of the head's work); a CUDA-graph capture needs fixed shapes
    arch = arch.replace(head_labeled_only=not cfg.pipeline.cuda_graphs)
    rank0 = info.rank == 0
    progress = common.Progress(
        out_dir / "metrics.jsonl", rank0, mesh.world_size, mesh.device, 0.0, None, unit="samples"
    )
    tokens, _ = common.token_file(args, out_dir, rank0)
    engine = train_loop.build_engine(args, mesh, cfg, arch)

    micro = cfg.train_micro_batch_size_per_gpu
    train = TokenDataset(tokens, args.seq_len - 2, "train", args.val_fraction)
    val = TokenDataset(tokens, args.seq_len - 2, "val", args.val_fraction)

    def loader(dataset, micro_batch=micro, **kw):
        batches = DistributedBatches(dataset, micro_batch, mesh.dp_rank, mesh.dp, **kw)
        return common.EpochLoop(
            batches,
            MLMBatch(batches, ids, vocab, args.mask_prob, args.seed, mesh.dp_rank, mesh.device),
        )

    loop = loader(train, seed=args.seed)
    engine.data_loader = loop
    progress.say(
        f"plait pretrain_bert: {args.model} {arch.num_parameters() / 1e6:.2f}M parameters, MLM at "
        f"sequence {args.seq_len}, tp={mesh.tp} x pp={mesh.pp} x cp={mesh.cp} x dp={mesh.dp} "
        f"on {mesh.device.type}, "
        f"{layout.zero_desc(cfg)}, {cfg.optimizer.type}, {cfg.precision}; global batch "
        f"{cfg.train_batch_size} samples; {len(train):,} train / {len(val):,} val samples"
    )
    summary = train_loop.run(
        args,
        engine,
        loop,
        lambda: loader(
            val,
            common.validation_micro_batch(len(val), micro, mesh.dp),
            shuffle=False,
            drop_last=True,
        ),
        progress,
        ckpt_dir,
        cfg.train_batch_size,
        rank0,
    )
    progress.close()
    dist.barrier()
    if rank0 and summary["step"] >= args.steps and not args.no_export:
        export_and_evaluate(ckpt_dir, out_dir, tok, ids, (train, val), args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
