"""Pipeline schedules on GPUs: measured step time and bubble beside the simulator's prediction.

    torchrun --nproc-per-node 4 benchmarks/bench_pipeline.py [--schedules 1f1b,interleaved,zb-h1] [--micro-batches 8,16]

Model: llama-886m (ANCHORS.md; 16 blocks) in bf16, sequence 2048, micro-batch 1, pp = world size.
Per configuration: 2 warm-up and --steps timed ``train_batch`` calls (forward + backward, no
optimizer). Measured bubble: the executor times each rank's compute actions with CUDA events
(``busy``); bubble = step / max_rank(busy) - 1 (idle over useful time of the busiest rank, the
simulator's definition). The prediction runs ``plait.parallel.simulate`` on the schedule's action
lists with t_F and t_B timed per chunk in isolation (B split evenly into BI and BW for zb-h1) and
reports makespan / max_rank(busy) - 1. The theory
column is the paper formula: (p-1)/m for 1F1B, (p-1)/(v m) interleaved, (p-1)/(3m) ZB-H1 (with F =
BI = BW). Prints a markdown table on rank 0 and writes JSON lines to --out.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

MICRO = 1


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_chunks(chunks, make_batch, hidden, seq, dtype, device, warmup=3, reps=8):
    """Mean seconds of forward and of backward for this rank's chunks on one micro-batch, timed in
    isolation (no communication) after ``warmup`` untimed repetitions."""
    tf = tb = 0.0
    for rep in range(warmup + reps):
        for chunk in chunks:
            batch = make_batch()
            first = 0 in chunk.layer_indices
            x = None if first else torch.randn(MICRO, seq, hidden, device=device, dtype=dtype,
                                               requires_grad=True)
            sync()
            t0 = time.perf_counter()
            out = chunk(hidden=x, **batch)
            sync()
            t1 = time.perf_counter()
            torch.autograd.backward(out, None if out.dim() == 0 else torch.ones_like(out))
            sync()
            if rep >= warmup:
                tf, tb = tf + (t1 - t0) / reps, tb + (time.perf_counter() - t1) / reps
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    return tf, tb


def main():
    from plait.layers import preset
    from plait.parallel import ParallelMesh, init_distributed
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline import PipelineParallel
    from plait.parallel.schedules import get_schedule
    from plait.parallel.simulate import simulate

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="1f1b,interleaved,zb-h1")
    parser.add_argument("--micro-batches", default="8,16", help="m values, comma-separated")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="bench_pipeline.jsonl")
    parser.add_argument("--preset", default="llama-886m")
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    info = init_distributed()
    mesh = ParallelMesh(tp=1, pp=info.world_size)
    p, device = mesh.pp, mesh.device
    cfg = preset(args.preset, max_position_embeddings=max(args.seq, 2048))
    SEQ = args.seq
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for schedule in args.schedules.split(","):
        v = 2 if schedule == "interleaved" else 1
        chunks = build_stage_modules(cfg, mesh, v=v, seed=0, device=device, dtype=dtype)
        gen = torch.Generator(device=device).manual_seed(mesh.pp_rank)

        def make_batch():
            ids = torch.randint(0, cfg.vocab_size, (MICRO, SEQ + 1), device=device, generator=gen)
            return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

        tf, tb = timed_chunks(chunks, make_batch, cfg.hidden_size, SEQ, dtype, device)
        costs = torch.tensor([tf, tb], device=device)
        every = [torch.zeros_like(costs) for _ in range(p)]
        dist.all_gather(every, costs)
        every = [tuple(x.tolist()) for x in every]
        for m in [int(x) for x in args.micro_batches.split(",")]:
            pipe = PipelineParallel(chunks, mesh, schedule=schedule, micro_batches=m)
            pipe.executor.time_compute = True
            times, busy = [], []
            for step in range(2 + args.steps):
                batches = [make_batch() for _ in range(m)]
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                pipe.train_batch(iter(batches))
                sync()
                dist.barrier()
                if step >= 2:
                    times.append(time.perf_counter() - t0)
                    busy.append(pipe.executor.busy_seconds)
                for chunk in chunks:
                    chunk.zero_grad(set_to_none=True)
            step_s = sum(times) / len(times)
            mine = torch.tensor([sum(busy) / len(busy)], device=device)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            ideal = mine.item()                                  # busiest rank's compute seconds
            # Simulator with this schedule and per-rank measured costs (chunk costs are per rank here,
            # v chunks share them evenly).
            lists = get_schedule(schedule, p, m, v)
            f_mean = sum(f for f, _ in every) / p / v
            b_mean = sum(b for _, b in every) / p / v
            sim = simulate(lists, p, v, cost_f=f_mean, cost_b=b_mean, cost_bi=b_mean / 2, cost_bw=b_mean / 2)
            predicted = sim.makespan / max(sim.busy) - 1
            theory = {"1f1b": (p - 1) / m, "interleaved": (p - 1) / (v * m), "zb-h1": (p - 1) / (3 * m)}[schedule]
            row = {"schedule": schedule, "p": p, "v": v, "m": m, "step_s": step_s, "ideal_s": ideal,
                   "bubble_measured": step_s / ideal - 1, "bubble_simulated": predicted, "bubble_theory": theory,
                   "tokens_per_s": m * MICRO * SEQ / step_s, "t_f": f_mean, "t_b": b_mean}
            rows.append(row)
            if info.rank == 0:
                print(json.dumps(row), flush=True)
        del chunks
    if info.rank == 0:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
        print(f"\n{args.preset} {dtype}, seq {SEQ}, micro-batch {MICRO}, pp={p} on {where}; "
              f"torch {torch.__version__}")
        print("| schedule | m | step s | tokens/s | bubble measured | bubble simulated | theory |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['schedule']}{' v=2' if r['v'] == 2 else ''} | {r['m']} | {r['step_s']:.3f} | "
                  f"{r['tokens_per_s'] / 1e3:.1f}k | {100 * r['bubble_measured']:.1f}% | "
                  f"{100 * r['bubble_simulated']:.1f}% | {100 * r['bubble_theory']:.1f}% |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
