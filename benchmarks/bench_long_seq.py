"""Issue 16 on one GPU: the longest sequence a model trains at cp=1, plain against the tiled loss and MLP.

    PYTHONPATH=$PWD python benchmarks/bench_long_seq.py [--model llama-886m] [--arms plain,tiled]
        [--seqs 16384,32768,65536,131072,262144] [--steps 2] [--out bench_long_seq.jsonl]

Each (arm, sequence length) trains ``--steps`` steps (after one warm-up step) in a process of its own (a
failure, e.g. CUDA out of memory, becomes a row with its error), through ``plait.initialize`` with ZeRO-1,
bf16, AdamW, clipping 1.0, micro-batch 1 and activation checkpointing of every block; an arm stops at its
first failure. Arms:

- plain: the preset as it is (the head's float32 logits ``[s, V]`` and each block's MLP activations whole).
- tiled: ``fused_loss_chunk_tokens`` and ``mlp_chunk_tokens`` 4096 (the loss in chunks of 4096 tokens,
  ``plait.layers.fused_cross_entropy``; the MLP in tiles of 4096 positions, ``plait.layers.tiled``).

Reported per row: tokens/s, MFU (6N + 6 x layers x hidden x seq per token, against 989 TFLOP/s), peak GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PEAK_FLOPS, batch, ds_like_config, init_single_process  # noqa: E402
from _common import model_flops_per_token, run_child  # noqa: E402

TILES = {"fused_loss_chunk_tokens": 4096, "mlp_chunk_tokens": 4096}


def run_one(arm: str, args) -> dict:
    import plait
    from plait.layers import TransformerModel
    from plait.models import preset
    from plait.parallel import ParallelMesh

    init_single_process()
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0)
    cfg = preset(args.model, max_position_embeddings=args.seq, **(TILES if arm == "tiled" else {}))
    model = TransformerModel(cfg, None, seed=0, device=device)
    conf = ds_like_config(1)
    conf["train_micro_batch_size_per_gpu"] = 1
    conf["activation_checkpointing"] = {"number_checkpoints": cfg.num_layers}
    engine = plait.initialize(model, conf, mesh=ParallelMesh())

    def step(i):
        loss = engine(**batch(cfg, device, i, micro=1, seq=args.seq))
        engine.backward(loss)
        engine.step()
        return loss

    step(0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        loss = step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    n = cfg.num_parameters()
    tokens = args.seq / dt
    return {
        "arm": arm,
        "model": args.model,
        "seq": args.seq,
        "tokens_per_s": tokens,
        "step_s": dt,
        "mfu": tokens * model_flops_per_token(cfg, n, args.seq) / PEAK_FLOPS,
        "loss": float(loss.detach()),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "params": n,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-886m")
    p.add_argument("--arms", default="plain,tiled")
    p.add_argument("--seqs", default="16384,32768,65536,131072,262144")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="bench_long_seq.jsonl")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return
    rows = []
    with open(args.out, "a") as f:
        for arm in args.arms.split(","):
            for seq in (int(s) for s in args.seqs.split(",")):
                child = ["--model", args.model, "--steps", str(args.steps), "--seq", str(seq)]
                log = f"{args.out}.{arm}-{seq}.log"  # the child's whole output (e.g. an out-of-memory trace)
                row = {
                    "seq": seq,
                    "model": args.model,
                    **run_child(__file__, arm, child, args.timeout, log_path=log),
                }
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(json.dumps(row), flush=True)
                if "error" in row:
                    break
    print(
        f"\n{args.model}, micro-batch 1, bf16, ZeRO-1, AdamW, activation checkpointing per block, one GPU\n"
    )
    print("| arm | seq | tokens/s | MFU | peak GiB |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['arm']} | {r['seq']} | failed: {r['error'][:80]} | | |")
        else:
            print(
                f"| {r['arm']} | {r['seq']} | {r['tokens_per_s'] / 1e3:.2f}k | {r['mfu']:.1%} "
                f"| {r['peak_gib']:.2f} |"
            )


if __name__ == "__main__":
    main()
