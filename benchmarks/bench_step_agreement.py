"""Cost of agreeing on a step's micro-batch verdict over the ranks (``plait.engine.guard.agreed_error``) on one GPU.

    python benchmarks/bench_step_agreement.py [--rounds 48]

At every accumulation boundary each rank all-reduces a flag ``[1]`` and reads it on the host (a
synchronization) before the optimizer step. One GPU has one rank, where the engine skips it; here the arm
``agree`` forces the same all-reduce and read (NCCL over a world of 1: the launch and the synchronization,
not the wire), against ``as shipped``. llama-886m, ZeRO-2, bf16, seq 2048, micro-batch 4 (``bench_input_checks``),
the arms taking turns step by step; reported: median step ms per arm and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_input_checks import MICRO, SEQ, batch, make_engine  # noqa: E402


def forced(problem, device):
    flag = torch.full((1,), int(problem is not None), dtype=torch.int32, device=device)
    dist.all_reduce(flag)
    return problem if int(flag.item()) else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=48)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    import plait.engine.guard as guard_mod

    shipped = guard_mod.agreed_error
    cfg, engine = make_engine()
    arms = {"as shipped": shipped, "agree": forced}
    seconds = {arm: [] for arm in arms}
    for r in range(args.rounds + 3):
        for k, arm in enumerate(list(arms) if r % 2 == 0 else list(arms)[::-1]):
            guard_mod.agreed_error = arms[arm]
            b = batch(cfg, 10 * r + k, "cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.backward(engine(**b))
            engine.step()
            torch.cuda.synchronize()
            if r >= 3:  # warm-up rounds dropped
                seconds[arm].append(time.perf_counter() - t0)
    print(
        f"device: {torch.cuda.get_device_name(0)}; llama-886m ZeRO-2 bf16, seq {SEQ}, micro-batch {MICRO}, "
        f"{args.rounds} steps per arm, taking turns"
    )
    base = statistics.median(seconds["as shipped"])
    for arm, s in seconds.items():
        med = statistics.median(s)
        print(f"{arm}: median step {med * 1e3:.3f} ms, {base / med:.4f} x as shipped's speed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
