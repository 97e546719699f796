"""Throughput of host-side AdamW implementations for ZeRO-Offload, in parameters per second.

Compares, on one flat float32 buffer of --numel parameters (fp32 weights, grads, exp_avg, exp_avg_sq):

* plait CPUAdam (AdamW mode), fused with the bf16 copy-out of the updated weights;
* plait CPUAdam (AdamW mode) without copy-out;
* torch.optim.AdamW(fused=True) on CPU float32, and the same followed by ``bf16.copy_(params)``
  (what an unfused offload step has to do to produce the bf16 weights);
* torch.optim.AdamW(foreach=True);
* DeepSpeedCPUAdam (adamw_mode=True), when ``deepspeed`` is importable and its op builds.

Every implementation uses --threads threads (numba threads for plait, torch.set_num_threads for the
others), runs --warmup untimed steps, then --steps timed steps. Reported: median and best seconds
per step and Gparams/s from the median. Memory needed: about 18 bytes x numel at a time.

    python benchmarks/bench_cpu_optimizers.py --numel 200_000_000 --threads 16 --steps 10
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numba
import torch

from plait.kernels import CPUAdam, compile_kernels

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def bench_plait(numel: int, threads: int, copy_out: bool, warmup: int, steps: int) -> list[float]:
    p, g = torch.randn(numel), torch.randn(numel)
    out = torch.empty(numel, dtype=torch.bfloat16) if copy_out else None
    opt = CPUAdam(p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True, num_threads=threads)
    return timed(lambda: opt.step(p, g, out), warmup, steps)


def bench_torch(numel: int, kind: str, copy_out: bool, warmup: int, steps: int) -> list[float]:
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **{kind: True})
    out = torch.empty(numel, dtype=torch.bfloat16) if copy_out else None

    def step():
        opt.step()
        if out is not None:
            out.copy_(p.detach())

    return timed(step, warmup, steps)


def bench_deepspeed(numel: int, warmup: int, steps: int) -> list[float] | str:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return "not installed"
    try:
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel)
        opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    except Exception as e:  # noqa: BLE001 - the C++ op is built on first use; any failure means "skip"
        return f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return timed(opt.step, warmup, steps)


def main(argv=None) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=lambda s: int(float(s)), default=200_000_000, help="parameters (accepts 5e6)")
    ap.add_argument("--threads", type=int, default=cores, help="threads for every implementation")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args = ap.parse_args(argv)
    if args.threads > numba.config.NUMBA_NUM_THREADS:
        ap.error(f"--threads {args.threads} > NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}; "
                 "raise NUMBA_NUM_THREADS in the environment")
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    report = compile_kernels(args.threads)
    compile_wall = time.perf_counter() - t0

    rows: list[tuple[str, list[float] | str]] = [
        ("plait CPUAdam (AdamW) + bf16 copy-out, fused", bench_plait(args.numel, args.threads, True, args.warmup, args.steps)),
        ("plait CPUAdam (AdamW), no copy-out", bench_plait(args.numel, args.threads, False, args.warmup, args.steps)),
        ("torch AdamW fused=True", bench_torch(args.numel, "fused", False, args.warmup, args.steps)),
        ("torch AdamW fused=True + bf16 copy_", bench_torch(args.numel, "fused", True, args.warmup, args.steps)),
        ("torch AdamW foreach=True", bench_torch(args.numel, "foreach", False, args.warmup, args.steps)),
        ("DeepSpeedCPUAdam (adamw_mode)", bench_deepspeed(args.numel, args.warmup, args.steps)),
    ]

    print(f"machine: {cpu_model()}; {cores} cores available ({os.cpu_count()} online); {platform.platform()}")
    print(f"versions: torch {torch.__version__}, numba {numba.__version__} "
          f"(threading layer {numba.threading_layer()}), python {platform.python_version()}")
    print(f"numel={args.numel:,}  threads={args.threads}  warmup={args.warmup}  steps={args.steps}")
    how = ("all loaded from numba's on-disk cache" if report.compiled == 0
           else f"{report.compiled} kernel signatures compiled, now cached")
    print(f"numba first-call time: {report.total_s:.2f} s ({how}; adam {report.seconds['adam']:.2f} s, "
          f"wall {compile_wall:.2f} s; cache: {report.cache_dir})\n")
    print("| implementation | median s/step | best s/step | Gparams/s (median) |")
    print("|---|---:|---:|---:|")
    for name, res in rows:
        if isinstance(res, str):
            print(f"| {name} | {res} | | |")
            continue
        med = statistics.median(res)
        print(f"| {name} | {med:.4f} | {min(res):.4f} | {args.numel / med / 1e9:.3f} |")


if __name__ == "__main__":
    main()
