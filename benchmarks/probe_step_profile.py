"""Where one training step's GPU time goes: torch.profiler over two steps of any ``bench_compile`` arm.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/probe_step_profile.py ARM [ARM ...] [--top 25]

Each arm runs in its own process (``bench_compile``'s model, batch and config), warms up (6 steps), then
profiles 2 steps and prints: step wall time, GPU busy time (sum of kernel times) and the top kernels by
total CUDA time, grouped by name. The gap between wall and busy time is host overhead and idle GPU.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def profile_arm(arm: str, top: int) -> None:
    import bench_compile as bc
    from torch.profiler import ProfilerActivity, profile
    torch.backends.cuda.matmul.allow_tf32 = True
    args = argparse.Namespace(plait_fused=True)
    step, _, _ = bc.make_arm(arm, bc.shape_config(), torch.device("cuda", 0), args, 10)
    for i in range(6):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(6, 8):
            step(i)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 2
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in events) / 2 / 1e3
    print(f"\n== {arm}: step wall {wall * 1e3:.1f} ms, GPU kernels {busy:.1f} ms per step")
    print("| ms/step | calls/step | kernel |\n|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"| {e.self_device_time_total / 2e3:.2f} | {e.count // 2} | {e.key[:110]} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arms", nargs="+")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        profile_arm(args.arms[0], args.top)
        return
    for arm in args.arms:
        subprocess.run([sys.executable, __file__, arm, "--top", str(args.top), "--one"], check=False)


if __name__ == "__main__":
    main()
