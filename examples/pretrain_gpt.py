"""Pretrain a decoder (Llama or GPT-2 family) with tensor x pipeline x context x ZeRO data parallelism.

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py            # CPU: tp=2 x pp=2, a few minutes
    python examples/pretrain_gpt.py                                 # one process (all GPUs if there are)
    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --model llama-886m --tp 2 --pp 2 \\
        --zero-stage 3 --seq-len 2048 --micro-batch 4 --global-batch 64 --steps 2000
    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --model llama-886m --tp 1 --pp 1 --cp 2 \\
        --seq-len 65536 --tile-tokens 4096 --recompute --micro-batch 1 --global-batch 1 --val-fraction 0.1
    torchrun --nproc-per-node 4 examples/pretrain_gpt.py --model mixtral-tiny --tp 1 --pp 2 --ep 2   # experts
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/pretrain_gpt.py ...                                # multi-node (or examples/slurm/)
    python examples/plot_metrics.py runs/pretrain_gpt/metrics.jsonl loss.png

With no arguments it trains ``llama-tiny`` (4 blocks, hidden 128, 8192-token BPE vocabulary) on the
bundled World English Bible for 300 steps. ``--config`` is a DeepSpeed-style JSON (default
examples/configs/pretrain_gpt.json); the flags override it. Every ``--log-every`` steps a progress line
(loss, lr, tokens/s, peak memory, grad norm, loss scale, MFU on GPUs); every ``--eval-every`` the
validation loss; everything also goes to ``<out-dir>/metrics.jsonl``. Checkpoints go to
``<out-dir>/checkpoints`` every ``--save-every`` steps with the data position; a new launch with the
same ``--out-dir`` continues from ``latest`` (also with another tp/pp/dp), which is what makes
``torchrun --max-restarts 1`` recover from a killed rank. ``--cp N`` splits every sequence over N ranks
(context parallelism, ring attention; ``--cp-method all_to_all`` for DeepSpeed-Ulysses), and
``--tile-tokens T`` computes the loss and the MLP in tiles of T positions, so a long sequence never holds its
whole ``[seq, vocab]`` logits or ``[seq, ffn]`` activations. A mixture-of-experts model (``--model
mixtral-tiny``, or ``--experts N --top-k K`` on another preset) splits its experts over ``--ep`` dp ranks, and
each progress line adds the experts' auxiliary loss and the load imbalance (max/mean tokens per expert, the
worst block). At the end the last checkpoint is exported to Hugging Face format (``<out-dir>/hf``) and
transformers samples a few lines from it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

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
)
from plait.models import preset


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    m = parser.add_argument_group("model and data")
    m.add_argument(
        "--model",
        default="llama-tiny",
        help="preset: llama-tiny, gpt2-tiny, gpt2-124m, llama-886m, ...",
    )
    m.add_argument("--hidden", type=int)
    m.add_argument("--layers", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--kv-heads", type=int)
    m.add_argument("--ffn", type=int, help="MLP hidden size")
    m.add_argument(
        "--experts", type=int, help="a mixture of experts in every block: this many experts"
    )
    m.add_argument("--top-k", type=int, help="experts per token (with --experts)")
    m.add_argument(
        "--seq-len", type=int, default=128, help="tokens per sequence (a multiple of 2 x cp)"
    )
    m.add_argument(
        "--tile-tokens",
        type=int,
        help="loss and MLP in tiles of this many positions (long sequences)",
    )
    m.add_argument(
        "--data",
        nargs="+",
        help="text files (tokenized once into <out-dir>/data), or one "
        "pre-tokenized .npy / plait .bin; default: the bundled corpus",
    )
    m.add_argument(
        "--tokenizer", help="a Hugging Face tokenizer.json (default: the bundled 8192-token BPE)"
    )
    m.add_argument("--val-fraction", type=float, default=0.02)
    m.add_argument("--prompt", default="In the beginning", help="text to continue after training")
    m.add_argument("--sample-tokens", type=int, default=40)
    m.add_argument(
        "--no-export", action="store_true", help="skip the Hugging Face export and sampling"
    )
    layout.add_parallel_args(parser, "pretrain_gpt.json")
    return parser.parse_args(argv)


def model_config(args, vocab: int):
    flags = {
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "num_heads": args.heads,
        "num_kv_heads": args.kv_heads,
        "ffn_hidden_size": args.ffn,
        "fused_loss_chunk_tokens": args.tile_tokens,
        "mlp_chunk_tokens": args.tile_tokens,
        "num_experts": args.experts,
        "moe_top_k": args.top_k,
    }
    over = {k: v for k, v in flags.items() if v is not None}
    cfg = preset(args.model, vocab_size=vocab, **over)
    if cfg.arch == "bert":
        raise SystemExit(f"--model {args.model} is an encoder; use examples/pretrain_bert.py")
    if cfg.max_position_embeddings < args.seq_len:
        cfg = cfg.replace(max_position_embeddings=args.seq_len)
    return cfg


def relaunch_on_local_gpus() -> None:
    """``python pretrain_gpt.py`` on a machine with several GPUs: re-run itself under torchrun on all."""
    if "RANK" in os.environ or "SLURM_PROCID" in os.environ or not torch.cuda.is_available():
        return
    n = torch.cuda.device_count()
    if n > 1:
        print(
            f"{n} GPUs and no launcher: re-running under torchrun --nproc-per-node {n}", flush=True
        )
        os.execv(
            sys.executable,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                *sys.argv,
            ],
        )


def export_and_sample(
    args, ckpt_dir: Path, out_dir: Path, tokenizer_path: Path, eos_id: int | None
) -> None:
    """Rank 0: write the last checkpoint as a Hugging Face model and continue ``--prompt`` with it."""
    from plait.checkpoint.convert import to_hf

    hf_dir = out_dir / "hf"
    t0 = time.perf_counter()
    report = to_hf(
        str(ckpt_dir),
        str(hf_dir),
        overwrite=True,
        tokenizer_from=str(tokenizer_path.parent if args.tokenizer else bundled_data_dir()),
    )
    print(
        f"exported {getattr(report, 'architecture', '')} to {hf_dir} in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    try:
        from tokenizers import Tokenizer
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        print(f"not sampling: {err} (pip install transformers)")
        return
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    tok = Tokenizer.from_file(str(tokenizer_path))
    ids = torch.tensor([tok.encode(args.prompt).ids])
    torch.manual_seed(0)
    with torch.no_grad():
        greedy = model.generate(
            ids, max_new_tokens=args.sample_tokens, do_sample=False, pad_token_id=eos_id
        )
        sampled = model.generate(
            ids,
            max_new_tokens=args.sample_tokens,
            do_sample=True,
            top_k=20,
            num_return_sequences=2,
            pad_token_id=eos_id,
        )
    print(f"\nsamples from the exported model (prompt {args.prompt!r}):")
    for name, seq in [("greedy", greedy[0])] + [("top-k 20", s) for s in sampled]:
        text = tok.decode(seq.tolist()).replace("\n", " / ")
        print(f"  [{name}] {text}")


def main(argv=None) -> None:
    relaunch_on_local_gpus()
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    ckpt_dir = out_dir / "checkpoints"
    tokenizer_path = Path(args.tokenizer) if args.tokenizer else bundled_tokenizer_path()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    arch = model_config(args, tok.get_vocab_size(with_added_tokens=True))
    info, mesh, cfg, _ = layout.setup(args, arch.hidden_size)
    rank0 = info.rank == 0
    progress = common.Progress(
        out_dir / "metrics.jsonl",
        rank0,
        mesh.world_size,
        mesh.device,
        common.flops_per_token(
            arch.num_parameters(), arch.num_layers, arch.hidden_size, args.seq_len
        ),
        common.peak_flops(mesh.device, args.peak_tflops),
    )
    tokens, _ = common.token_file(args, out_dir, rank0)
    engine = train_loop.build_engine(args, mesh, cfg, arch)

    micro, gas = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    to_device = lambda b: {k: v.to(mesh.device, non_blocking=True) for k, v in b.items()}
    train = TokenDataset(tokens, args.seq_len, "train", args.val_fraction)
    val = TokenDataset(tokens, args.seq_len, "val", args.val_fraction)
    loop = common.EpochLoop(
        DistributedBatches(train, micro, mesh.dp_rank, mesh.dp, seed=args.seed), to_device
    )
    engine.data_loader = loop

    val_micro = common.validation_micro_batch(len(val), micro, mesh.dp)

    def val_loader():
        return common.EpochLoop(
            DistributedBatches(
                val, val_micro, mesh.dp_rank, mesh.dp, shuffle=False, drop_last=True
            ),
            to_device,
        )

    progress.say(
        f"plait pretrain_gpt: {args.model} {arch.num_parameters() / 1e6:.2f}M parameters "
        f"({arch.num_layers} blocks, hidden {arch.hidden_size}, vocab {arch.vocab_size}), "
        f"tp={mesh.tp} x pp={mesh.pp} x cp={mesh.cp} x dp={mesh.dp} on {mesh.device.type}, "
        f"schedule {cfg.pipeline.schedule if mesh.pp > 1 else '-'}, {layout.zero_desc(cfg)}, {cfg.precision}; "
        f"global batch {cfg.train_batch_size} x {args.seq_len} tokens (micro {micro} x accumulation "
        f"{gas} x dp {mesh.dp}); {len(train):,} train / {len(val):,} val samples"
    )

    summary = train_loop.run(
        args,
        engine,
        loop,
        val_loader,
        progress,
        ckpt_dir,
        cfg.train_batch_size * args.seq_len,
        rank0,
    )
    step = summary["step"]
    progress.close()
    dist.barrier()
    if rank0 and step >= args.steps and not args.no_export:
        export_and_sample(args, ckpt_dir, out_dir, tokenizer_path, tok.token_to_id("<|endoftext|>"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
