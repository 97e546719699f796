"""ZeRO-Offload on one GPU: plait vs DeepSpeed, in the same run.

    python benchmarks/bench_offload.py                    # (a) then (b)
    python benchmarks/bench_offload.py --part a --steps 10
    python benchmarks/bench_offload.py --part b --sizes 1b,3b,7b
    PLAIT_OFFLOAD_THREADS=15 python benchmarks/bench_offload.py ...   # CPU optimizer threads (default: all)
    PLAIT_DEVICE_STEP=0.5 python benchmarks/bench_offload.py --part a --arms plait  # a fixed device share
    PLAIT_DEVICE_STEP=0 python benchmarks/bench_offload.py --part a   # all on the CPU (default on a GPU: "auto")
    python benchmarks/bench_offload.py --device cpu --part a --arms plait   # smoke test without a GPU

(a) llama-886m (ANCHORS.md), sequence 2048, micro-batch 4, bf16, AdamW (lr 1e-4, wd 0.1, betas 0.9/0.95),
    gradient clipping 1.0, ZeRO-2 + ``offload_optimizer: {device: cpu, pin_memory: true}``: plait (numba
    CPUAdam, host step overlapped as in plait.zero.offload) vs DeepSpeed (DeepSpeedCPUAdam). Reported:
    tokens/s, peak GPU memory (torch.cuda.max_memory_allocated), step time, mean of the timed steps.
    Target: plait >= 2x DeepSpeed's tokens/s at no more peak memory.
(b) the largest Llama-style model that trains with ZeRO-3 + offload_param + offload_optimizer on one
    GPU, for plait and for DeepSpeed: sizes ascend (``SIZES``), each tried for a few steps in a fresh
    process (micro-batch 1, sequence 2048); an arm stops at its first failure (CUDA OOM, host OOM). A
    size whose host footprint (about 18 bytes/parameter: fp32 master, two Adam moments, fp32 gradient,
    bf16 parameter shard; DeepSpeed needs the same) exceeds 90% of MemAvailable is skipped, not tried, so
    the host is never driven into swap or the OOM killer. Reported: largest size completed, tokens/s.

--clip sets gradient_clipping for both arms (default 1.0; 0 = DeepSpeed's default, no clipping, which
lets plait step each gradient segment on the host while backward runs). --profile adds, per arm, three
extra steps timed phase by phase with device synchronization (forward, backward, step() call, and
for plait the wait for the overlapped host step), reported as "profile".

Every arm runs in its own process (fresh CUDA memory statistics) and prints one ``RESULT {json}`` line;
the parent prints markdown tables and writes JSON lines to --out. Model code is plait's
``TransformerModel`` (tp=1) for both frameworks, so the arms differ only in the training wrapper. Each
arm initializes a 1-rank process group (NCCL on GPU, gloo with --device cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from _offload_arm import SIZES, model_config, run_arm

# host bytes/parameter of ZeRO-3 + full offload at GAS 1 (bf16): fp32 master 4, Adam moments 8, gradient
# partition (plait keeps backward's bf16 gradient: 2; DeepSpeed an fp32 one: 4), bf16 parameter shard 2
HOST_BYTES_PER_PARAM = {"plait": 16.0, "ds": 18.0}


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def spawn(args, framework, size, stage, micro, offload_param, steps) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        framework,
        "--size",
        size,
        "--stage",
        str(stage),
        "--micro",
        str(micro),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(steps),
        "--device",
        args.device,
        "--clip",
        str(args.clip),
    ]
    if args.profile:
        cmd.append("--profile")
    if offload_param:
        cmd.append("--offload-param")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {
            "framework": framework,
            "size": size,
            "error": f"timed out after {args.timeout:.0f} s",
            "oom": False,
        }
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is not None:
        return json.loads(line[7:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    oom = "out of memory" in (proc.stderr + proc.stdout).lower() or proc.returncode in (-9, 137)
    return {
        "framework": framework,
        "size": size,
        "error": " | ".join(tail)[-300:],
        "oom": oom,
        "wall_s": time.perf_counter() - t0,
    }


def part_a(args, rows):
    print(
        f"\n(a) llama-886m, ZeRO-2 + offload_optimizer, seq 2048, micro-batch 4, bf16, AdamW, clip {args.clip}",
        flush=True,
    )
    out = []
    for fw in args.arms.split(","):
        r = spawn(args, fw, "886m", 2, 4, False, args.steps)
        r["part"] = "a"
        out.append(r)
        rows.append(r)
        print(json.dumps(r), flush=True)
    return out


def part_b(args, rows):
    print(
        "\n(b) largest model, ZeRO-3 + offload_param + offload_optimizer, seq 2048, micro-batch 1",
        flush=True,
    )
    sizes = args.sizes.split(",") if args.device == "cuda" else ["tiny"]
    best = {}
    for fw in args.arms.split(","):
        for size in sizes:
            n = model_config(size, args.device).num_parameters()
            need, have = HOST_BYTES_PER_PARAM[fw] * n / 2**30, mem_available_gib()
            if args.device == "cuda" and need > 0.9 * have:
                r = {
                    "framework": fw,
                    "size": size,
                    "params": n,
                    "error": f"skipped: needs ~{need:.0f} GiB host memory, {have:.0f} GiB available",
                    "oom": True,
                }
            else:
                r = spawn(args, fw, size, 3, 1, True, args.search_steps)
            r["part"] = "b"
            rows.append(r)
            print(json.dumps(r), flush=True)
            if "error" in r:
                break
            best[fw] = r
    return best


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", default="ab", help="a, b or ab")
    parser.add_argument("--arms", default="plait,ds", help="frameworks: plait,ds")
    parser.add_argument(
        "--sizes", default=",".join(SIZES), help=f"part (b) sizes, ascending ({','.join(SIZES)})"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of part (a)")
    parser.add_argument(
        "--search-steps", type=int, default=2, help="timed steps per size in part (b)"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per arm process")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu")
    )
    parser.add_argument("--out", default="bench_offload.jsonl")
    parser.add_argument(
        "--clip", type=float, default=1.0, help="gradient_clipping of both arms (0: off)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="phase-by-phase timing of 3 extra steps"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="886m", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--offload-param", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        r = run_arm(
            args.one,
            args.size,
            args.stage,
            args.micro,
            args.offload_param,
            args.warmup,
            args.steps,
            args.device,
            args.clip,
            args.profile,
        )
        print("RESULT " + json.dumps(r), flush=True)
        return
    rows = []
    a = part_a(args, rows) if "a" in args.part else []
    best = part_b(args, rows) if "b" in args.part else {}
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU smoke test (tiny model)"
    threads = os.environ.get("PLAIT_OFFLOAD_THREADS", f"all ({os.cpu_count()})")
    print(
        f"\n{name}; torch {torch.__version__}; {os.cpu_count()} cores; plait offload threads: {threads}"
    )
    if a:
        print(
            f"\n(a) llama-886m ZeRO-2 + offload_optimizer (seq 2048, micro-batch 4, bf16, AdamW, clip {args.clip})\n"
        )
        print(
            "| framework | tokens/s | step s | peak GPU GiB | host RSS GiB |\n|---|---|---|---|---|"
        )
        for r in a:
            if "error" in r:
                print(f"| {r['framework']} | failed: {r['error'][:120]} | | | |")
            else:
                print(
                    f"| {r['framework']} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {r['peak_gib']:.2f} | "
                    f"{r['host_rss_gib']:.1f} |"
                )
        ok = {r["framework"]: r for r in a if "error" not in r}
        if "plait" in ok and "ds" in ok:
            print(
                f"\nplait / DeepSpeed tokens/s: {ok['plait']['tokens_per_s'] / ok['ds']['tokens_per_s']:.2f}x; "
                f"peak memory {ok['plait']['peak_gib']:.2f} vs {ok['ds']['peak_gib']:.2f} GiB"
            )
    if "b" in args.part:
        print(
            "\n(b) ZeRO-3 + offload_param + offload_optimizer, largest model that trains (seq 2048, micro-batch 1)\n"
        )
        print(
            "| framework | size | parameters | tokens/s | step s | peak GPU GiB | host RSS GiB | next size |\n"
            "|---|---|---|---|---|---|---|---|"
        )
        for fw in args.arms.split(","):
            r = best.get(fw)
            stop = next(
                (x for x in rows if x.get("part") == "b" and x["framework"] == fw and "error" in x),
                None,
            )
            why = stop["error"][:80] if stop else "(all sizes trained)"
            if r is None:
                print(f"| {fw} | none | | | | | | {why} |")
            else:
                print(
                    f"| {fw} | {r['size']} | {r['params'] / 1e9:.2f}B | {r['tokens_per_s']:.0f} | {r['step_s']:.2f} | "
                    f"{r['peak_gib']:.2f} | {r['host_rss_gib']:.1f} | {why} |"
                )


if __name__ == "__main__":
    main()
