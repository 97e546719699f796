"""Checkpoint save and load throughput (GB/s) of a full training state: llama-886m under the engine
(bf16 weights, fp32 master weights and AdamW moments: about 14 bytes/parameter on disk).

    torchrun --nproc-per-node 4 benchmarks/bench_checkpoint.py [--stage 1] [--dir /tmp/ckpt]

Each rank writes its own slices in parallel (fsync included, crash-safe rename and ``latest``),
then every rank loads them back into the same layout, and, with --reshard, into ZeRO stage 3 at
the same dp size (a different partition). Reported: bytes on disk, seconds, GB/s (1e9 bytes/s),
after one optimizer step so the moments exist. Prints a markdown table on rank 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def make_engine(stage, mesh, preset_name):
    import plait
    from plait.layers import TransformerModel
    from plait.models import preset

    model = TransformerModel(preset(preset_name), mesh, seed=0, device=mesh.device)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 50_000_000,
            "allgather_bucket_size": 50_000_000,
        },
    }
    return plait.initialize(model, cfg, mesh=mesh), model.config


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def main():
    from plait.parallel import ParallelMesh, init_distributed

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--dir", default="/tmp/plait-ckpt-bench")
    parser.add_argument("--preset", default="llama-886m")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reshard", action="store_true")
    args = parser.parse_args()
    info = init_distributed()
    mesh = ParallelMesh()
    engine, cfg = make_engine(args.stage, mesh, args.preset)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq + 1), device=mesh.device)
    engine.train_batch(iter([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}]))
    if info.rank == 0 and os.path.exists(args.dir):
        shutil.rmtree(args.dir)
    sync()
    rows = []
    t0 = time.perf_counter()
    engine.save_checkpoint(args.dir, tag="bench")
    sync()
    save_s = time.perf_counter() - t0
    size = dir_bytes(os.path.join(args.dir, "bench")) if info.rank == 0 else 0
    rows.append(("save", args.stage, save_s))
    t0 = time.perf_counter()
    engine.load_checkpoint(args.dir, tag="bench")
    sync()
    rows.append(("load", args.stage, time.perf_counter() - t0))
    if args.reshard:
        del engine
        other, _ = make_engine(3 if args.stage != 3 else 1, mesh, args.preset)
        sync()
        t0 = time.perf_counter()
        other.load_checkpoint(args.dir, tag="bench")
        sync()
        rows.append(("load, resharded", 3 if args.stage != 3 else 1, time.perf_counter() - t0))
    if info.rank == 0:
        where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
        print(
            f"\n{args.preset}, {info.world_size} ranks (dp), saved at ZeRO-{args.stage}, {size / 1e9:.2f} GB on "
            f"disk at {args.dir}; {where}; torch {torch.__version__}"
        )
        print("| operation | ZeRO stage | seconds | GB/s |\n|---|---|---|---|")
        for op, stage, sec in rows:
            print(f"| {op} | {stage} | {sec:.2f} | {size / 1e9 / sec:.2f} |")
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
