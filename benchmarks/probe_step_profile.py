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

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def profile_arm(arm: str, top: int) -> None:
    import bench_compile as bc
    from _common import profile_steps

    torch.backends.cuda.matmul.allow_tf32 = True
    args = argparse.Namespace(plait_fused=True)
    step, _, _ = bc.make_arm(arm, bc.shape_config(), torch.device("cuda", 0), args, 10)
    for i in range(6):
        step(i)
    profile_steps(step, 6, arm, top)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("arms", nargs="+")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        profile_arm(args.arms[0], args.top)
        return
    for arm in args.arms:
        subprocess.run(
            [sys.executable, __file__, arm, "--top", str(args.top), "--one"], check=False
        )


if __name__ == "__main__":
    main()
