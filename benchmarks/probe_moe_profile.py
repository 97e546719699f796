"""Where a mixture-of-experts layer's step goes on one GPU: ``torch.profiler`` over forward + backward of
``plait.layers.MoE`` (bf16, dropless, grouped GEMM) against the dense SwiGLU MLP of the same active parameters.

    PYTHONPATH=$PWD python benchmarks/probe_moe_profile.py [--hidden 2048] [--ffn 3584] [--experts 8]
        [--top-k 2] [--tokens 8192] [--steps 10] [--rows 25]

Prints, per arm, the wall time per step and the top CUDA kernels and CPU ops by total time over ``--steps``
profiled steps (after 3 warm-up steps). A probe: its output goes to ``benchmarks/results/`` by hand.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_moe_layer import build, run


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, default in (
        ("hidden", 2048),
        ("ffn", 3584),
        ("experts", 8),
        ("top-k", 2),
        ("tokens", 8192),
        ("steps", 10),
        ("rows", 25),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(
        args.tokens // 2048, 2048, args.hidden, device=device, dtype=torch.bfloat16, generator=g
    )
    up = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=g)
    x.requires_grad_()
    for arm in ("moe-grouped", "dense"):
        layer, _ = build(arm, args, device)
        for _ in range(3):
            run(layer, x, up)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            run(layer, x, up)
        torch.cuda.synchronize()
        print(
            f"== {arm}: {1e3 * (time.perf_counter() - t0) / args.steps:.2f} ms per forward + backward",
            flush=True,
        )
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                run(layer, x, up)
            torch.cuda.synchronize()
        table = prof.key_averages()
        print(
            table.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60),
            flush=True,
        )
        print(
            table.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60),
            flush=True,
        )


if __name__ == "__main__":
    main()
