"""ZeRO-3 training of an unmodified Hugging Face transformers model (the DeepSpeed-with-HF use case).

    torchrun --nproc-per-node 2 examples/finetune_hf.py                 # random small GPT-2, dp=2, ZeRO-3
    torchrun --nproc-per-node 2 examples/finetune_hf.py --arch llama    # random small LlamaForCausalLM
    torchrun --nproc-per-node 4 examples/finetune_hf.py --hf-dir PATH   # any saved causal LM + its tokenizer.json
    torchrun --nproc-per-node 2 examples/finetune_hf.py --offload optimizer   # ZeRO-Offload of the optimizer

The model is used as transformers builds it: ``plait.initialize`` shards its parameters, gradients and
optimizer state over the data-parallel ranks (ZeRO stage from ``--config``, default
examples/configs/pretrain_hf_zero3.json, or ``--zero-stage``), and the loop is DeepSpeed's::

    loss = engine(**batch).loss        # HF models return an output object
    engine.backward(loss)
    engine.step()                      # applies at the gradient accumulation boundary

The corpus is the bundled one, tokenized with the bundled tokenizer (or ``--hf-dir``'s tokenizer.json).
At the end the engine writes a layout-free checkpoint to ``<out-dir>/checkpoints`` (it records the model's
class and config.json), and the way back to Hugging Face is::

    plait convert to-hf runs/finetune_hf/checkpoints runs/finetune_hf/hf [--tokenizer-from HF_DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrain_common as common
import pretrain_layout as layout

import plait
from plait.config import load_config
from plait.data import (
    DistributedBatches,
    TokenDataset,
    build_token_file,
    bundled_corpus_path,
    bundled_token_file,
    bundled_tokenizer_path,
)
from plait.parallel import ParallelMesh, init_distributed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--arch",
        choices=["gpt2", "llama"],
        default="gpt2",
        help="random small model of this family",
    )
    p.add_argument(
        "--hf-dir", help="a saved transformers causal LM with tokenizer.json (instead of --arch)"
    )
    p.add_argument(
        "--config",
        "--deepspeed_config",
        dest="config",
        default=str(layout.EXAMPLES / "configs" / "pretrain_hf_zero3.json"),
    )
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    p.add_argument("--offload", choices=["none", "optimizer", "param", "all"])
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--out-dir", default="runs/finetune_hf")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def build_model(args, vocab: int):
    """The transformers model, unmodified (random init from a small config, or from_pretrained)."""
    import transformers

    if args.hf_dir:
        return transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32)
    torch.manual_seed(args.seed)
    if args.arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=max(256, args.seq_len),
            n_embd=128,
            n_layer=4,
            n_head=4,
            eos_token_id=5,
            bos_token_id=5,
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(256, args.seq_len),
        eos_token_id=5,
        bos_token_id=5,
    )
    return transformers.LlamaForCausalLM(config)


def ds_config(args) -> dict:
    with open(args.config, encoding="utf-8") as f:
        cfg = json.load(f)
    layout.apply_zero_flags(cfg, args)
    cfg["steps_per_print"] = (
        0  # the script prints its own line every --log-every steps: not a second one
    )
    if args.micro_batch:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.grad_accum:
        cfg["gradient_accumulation_steps"] = args.grad_accum
        cfg.pop("train_batch_size", None)
    if args.lr:
        cfg.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
        if "warmup_max_lr" in cfg.get("scheduler", {}).get("params", {}):
            cfg["scheduler"]["params"]["warmup_max_lr"] = args.lr
    return cfg


def main(argv=None) -> None:
    args = parse_args(argv)
    from tokenizers import Tokenizer

    info = init_distributed()
    rank0 = info.rank == 0
    mesh = ParallelMesh(tp=1, pp=1)  # HF models: data parallel (ZeRO) only
    tok_path = Path(args.hf_dir) / "tokenizer.json" if args.hf_dir else bundled_tokenizer_path()
    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size(with_added_tokens=True)
    if args.hf_dir:
        out = Path(args.out_dir) / "data" / "tokens.bin"
        tokens = common.rank0_first(
            lambda: (
                out
                if out.is_file()
                else build_token_file(bundled_corpus_path(), tok_path, out, dtype="uint32")
            ),
            rank0,
        )
    else:
        tokens = common.rank0_first(bundled_token_file, rank0)

    model = build_model(args, vocab).to(mesh.device)
    cfg = load_config(
        ds_config(args),
        dp_size=mesh.dp,
        model_hidden_size=model.config.hidden_size,
        mixed_precision="bf16" if mesh.device.type == "cuda" else "fp32",
        warmup_num_steps=max(1, args.steps // 10),
        total_num_steps=args.steps,
    )
    engine = plait.initialize(model, cfg, mesh=mesh)  # raises for what it cannot do (e.g. offload)

    micro, gas = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    data = TokenDataset(tokens, args.seq_len, "train", 0.02)
    loop = common.EpochLoop(DistributedBatches(data, micro, mesh.dp_rank, mesh.dp, seed=args.seed))
    engine.data_loader = loop
    n_params = (
        sum(p.numel() for p in model.parameters()) if cfg.zero_optimization.stage < 3 else None
    )
    if rank0:
        size = f"{n_params / 1e6:.2f}M parameters" if n_params else "parameters sharded by ZeRO-3"
        print(
            f"plait finetune_hf: {type(model).__name__} ({size}), dp={mesh.dp}, {layout.zero_desc(cfg)}, "
            f"micro-batch {micro} x accumulation {gas} x dp {mesh.dp}, sequence {args.seq_len}",
            flush=True,
        )
    losses, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        total = 0.0
        for _ in range(gas):
            batch = next(loop)
            ids = batch["input_ids"].to(mesh.device)
            loss = engine(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / gas
        mean = torch.tensor([total], device=mesh.device)
        dist.all_reduce(mean)
        losses.append(float(mean) / mesh.dp)
        if rank0 and (step % args.log_every == 0 or step == 1 or step == args.steps):
            elapsed = time.perf_counter() - t0
            print(
                f"step {step:>4}/{args.steps} | loss {losses[-1]:.4f} | lr {engine.get_lr()[0]:.2e} | "
                f"grad norm {engine.grad_norm or 0.0:.3f} | skipped {engine.skipped_steps} | "
                f"{step * cfg.train_batch_size / elapsed:.1f} samples/s | {common.fmt_time(elapsed)} elapsed, "
                f"ETA {common.fmt_time(elapsed / step * (args.steps - step))}",
                flush=True,
            )
    engine.save_checkpoint(
        str(Path(args.out_dir) / "checkpoints"), client_state={"step": args.steps}
    )
    if rank0:
        print(
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps "
            f"({time.perf_counter() - t0:.1f}s); checkpoint in {Path(args.out_dir) / 'checkpoints'}\n"
            f"to Hugging Face: plait convert to-hf {Path(args.out_dir) / 'checkpoints'} {Path(args.out_dir) / 'hf'}"
            + (f" --tokenizer-from {args.hf_dir}" if args.hf_dir else "")
        )
        with open(Path(args.out_dir) / "losses.json", "w", encoding="utf-8") as f:
            json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
