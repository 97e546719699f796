"""Throughput of host-side AdamW implementations for ZeRO-Offload, in parameters per second.

Compares, on one flat float32 buffer of --numel parameters (fp32 weights, grads, exp_avg, exp_avg_sq):

* plait CPUAdam (AdamW mode), fused with the bf16 copy-out of the updated weights, with fp32
  gradients and with bf16 gradients (what a bf16 model's backward produces; read without widening);
* plait CPUAdam (AdamW mode) without copy-out;
* torch.optim.AdamW(fused=True) on CPU float32, and the same followed by ``bf16.copy_(params)``
  (what an unfused offload step has to do to produce the bf16 weights);
* torch.optim.AdamW(foreach=True);
* DeepSpeedCPUAdam (adamw_mode=True), when ``deepspeed`` is importable and its op builds, alone and
  followed by ``bf16.copy_(params)`` (its ZeRO-Offload engine makes the bf16 weights in a second pass).

With ``--probe``: the host's memory-traffic ceiling for this access pattern (a numba loop with
Adam's loads and stores and no arithmetic to speak of, so Gparams/s there is the most any AdamW can
reach at those bytes per parameter), the same at half the threads (does bandwidth scale with cores,
i.e. is it per-core limited?), and, on a CUDA machine, the plait kernel while another thread keeps
pinned host<->device copies running (does DMA traffic slow the host step?).

Every implementation uses --threads threads (numba threads for plait, torch.set_num_threads for the
others), runs --warmup untimed steps, then --steps timed rounds, interleaved (one step of each per round). Reported: median and best seconds
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
import numpy as np
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


DS = "DeepSpeedCPUAdam (adamw_mode)"
DS_COPY = "DeepSpeedCPUAdam (adamw_mode) + bf16 copy_"


def interleaved(steps_of: dict, warmup: int, rounds: int) -> list[tuple[str, list[float] | str]]:
    """Seconds per step of each callable in ``steps_of`` (name -> step, or a string: not runnable), one
    step of each in turn per round, after ``warmup`` untimed steps of each."""
    runnable = {k: f for k, f in steps_of.items() if callable(f)}
    for f in runnable.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in runnable}
    for _ in range(rounds):
        for k, f in runnable.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return [(k, times.get(k, v)) for k, v in steps_of.items()]


def timed(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def make_plait(numel: int, threads: int, copy_out: bool, grad_dtype: torch.dtype = torch.float32):
    p, g = torch.randn(numel), torch.randn(numel).to(grad_dtype)
    out = torch.empty(numel, dtype=torch.bfloat16) if copy_out else None
    opt = CPUAdam(
        p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True, num_threads=threads
    )
    return lambda: opt.step(p, g, out)


def param_with_grad(numel: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    return p


def torch_style_step(opt, p: torch.nn.Parameter, copy_out: bool):
    """``opt.step()``, then (``copy_out``) the bf16 copy of the updated weights an offload engine needs."""
    out = torch.empty(p.numel(), dtype=torch.bfloat16) if copy_out else None

    def step():
        opt.step()
        if out is not None:
            out.copy_(p.detach())

    return step


def make_torch(numel: int, kind: str, copy_out: bool):
    p = param_with_grad(numel)
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **{kind: True})
    return torch_style_step(opt, p, copy_out)


def make_deepspeed(numel: int, copy_out: bool = False):
    """The step callable, or a string saying why DeepSpeed cannot run."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return "not installed"
    try:
        p = param_with_grad(numel)
        opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    except Exception as e:  # noqa: BLE001 - the C++ op is built on first use; any failure means "skip"
        return f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return torch_style_step(opt, p, copy_out)


@numba.njit(parallel=True, nogil=True, cache=True)
def _adam_traffic(p, g, m, v, out):
    """Adam's memory traffic (read p, g, m, v; write p, m, v and a 2-byte copy) with trivial arithmetic."""
    for i in numba.prange(p.shape[0]):
        a = g[i]
        m[i] = m[i] + a
        v[i] = v[i] + a
        w = p[i] + a
        p[i] = w
        out[i] = np.uint16(np.uint32(np.float32(w).view(np.uint32)) >> np.uint32(16))


def bench_traffic(numel: int, threads: int, warmup: int, steps: int) -> list[float]:
    p, g, m, v = (
        np.random.default_rng(k).standard_normal(numel, dtype=np.float32) for k in range(4)
    )
    out = np.empty(numel, np.uint16)
    prev = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        return timed(lambda: _adam_traffic(p, g, m, v, out), warmup, steps)
    finally:
        numba.set_num_threads(prev)


def bench_plait_with_dma(numel: int, threads: int, warmup: int, steps: int) -> list[float] | str:
    """plait AdamW + bf16 copy-out while a second thread keeps 1 GiB pinned copies running both ways."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    import threading

    n = 2**28  # 1 GiB of float32 each way
    host_a, host_b = torch.empty(n, pin_memory=True), torch.empty(n, pin_memory=True)
    dev_a, dev_b = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    stop = threading.Event()
    moved = [0]

    def pump():
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        while not stop.is_set():
            with torch.cuda.stream(s1):
                dev_a.copy_(host_a, non_blocking=True)
            with torch.cuda.stream(s2):
                host_b.copy_(dev_b, non_blocking=True)
            s1.synchronize()
            s2.synchronize()
            moved[0] += 2 * n * 4

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    t0 = time.perf_counter()
    try:
        res = timed(make_plait(numel, threads, True), warmup, steps)
    finally:
        stop.set()
        t.join()
    print(
        f"(DMA pump moved {moved[0] / (time.perf_counter() - t0) / 1e9:.1f} GB/s host<->device meanwhile)"
    )
    return res


def main(argv=None) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--numel",
        type=lambda s: int(float(s)),
        default=200_000_000,
        help="parameters (accepts 5e6)",
    )
    ap.add_argument("--threads", type=int, default=cores, help="threads for every implementation")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument(
        "--only", default="", help="comma-separated substrings: run only rows whose name has one"
    )
    ap.add_argument(
        "--probe",
        action="store_true",
        help="also the memory-traffic ceiling and the DMA-contention run",
    )
    args = ap.parse_args(argv)
    if args.threads > numba.config.NUMBA_NUM_THREADS:
        ap.error(
            f"--threads {args.threads} > NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}; "
            "raise NUMBA_NUM_THREADS in the environment"
        )
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    report = compile_kernels(args.threads)
    compile_wall = time.perf_counter() - t0

    n, th, w, st = args.numel, args.threads, args.warmup, args.steps
    half = max(1, th // 2)
    makers = [
        ("plait CPUAdam (AdamW) + bf16 copy-out, fused", lambda: make_plait(n, th, True)),
        (
            "plait CPUAdam (AdamW) + bf16 copy-out, bf16 grads",
            lambda: make_plait(n, th, True, torch.bfloat16),
        ),
        ("plait CPUAdam (AdamW), no copy-out", lambda: make_plait(n, th, False)),
        ("torch AdamW fused=True", lambda: make_torch(n, "fused", False)),
        ("torch AdamW fused=True + bf16 copy_", lambda: make_torch(n, "fused", True)),
        ("torch AdamW foreach=True", lambda: make_torch(n, "foreach", False)),
        (DS, lambda: make_deepspeed(n)),
        (DS_COPY, lambda: make_deepspeed(n, True)),
    ]
    wanted = [x for x in args.only.split(",") if x]
    steps_of = {
        name: make() for name, make in makers if not wanted or any(x in name for x in wanted)
    }
    rows = interleaved(steps_of, w, st)
    if args.probe:
        rows += [
            (
                f"ceiling: Adam's loads/stores + 2-byte copy, no math ({th} threads)",
                bench_traffic(n, th, w, st),
            ),
            (f"ceiling: same, {half} threads", bench_traffic(n, half, w, st)),
            (
                f"plait CPUAdam + bf16 copy-out, {half} threads",
                timed(make_plait(n, half, True), w, st),
            ),
            (
                "plait CPUAdam + bf16 copy-out, pinned copies running",
                bench_plait_with_dma(n, th, w, st),
            ),
        ]

    print(
        f"machine: {cpu_model()}; {cores} cores available ({os.cpu_count()} online); {platform.platform()}"
    )
    print(
        f"versions: torch {torch.__version__}, numba {numba.__version__} "
        f"(threading layer {numba.threading_layer()}), python {platform.python_version()}"
    )
    print(f"numel={args.numel:,}  threads={args.threads}  warmup={args.warmup}  steps={args.steps}")
    how = (
        "all loaded from numba's on-disk cache"
        if report.compiled == 0
        else f"{report.compiled} kernel signatures compiled, now cached"
    )
    print(
        f"numba first-call time: {report.total_s:.2f} s ({how}; adam {report.seconds['adam']:.2f} s, "
        f"wall {compile_wall:.2f} s; cache: {report.cache_dir})\n"
    )
    ds, ds_copy = dict(rows).get(DS), dict(rows).get(DS_COPY)
    print(
        f"Rows above the ceiling lines ran interleaved: each of {args.steps} rounds times one step of every "
        "implementation in turn, so drift in the host's load hits all alike. 'vs DS step' is the median over "
        "rounds of DeepSpeedCPUAdam's step time / this row's (same round); 'vs DS step + copy' the same "
        "against DeepSpeedCPUAdam followed by the bf16 copy of the weights that DeepSpeed's ZeRO-Offload "
        "engine makes after every step (stage_1_and_2.py: bit16_partition_buffer.copy_(fp32_partition)).\n"
    )
    print(
        "| implementation | median s/step | best s/step | Gparams/s (median) | vs DS step | vs DS step + copy |"
    )
    print("|---|---:|---:|---:|---:|---:|")

    def paired(ref, res):
        ok = isinstance(ref, list) and len(ref) == len(res)
        return f"{statistics.median(d / r for d, r in zip(ref, res)):.2f}x" if ok else ""

    for name, res in rows:
        if isinstance(res, str):
            print(f"| {name} | {res} | | | | |")
            continue
        med = statistics.median(res)
        print(
            f"| {name} | {med:.4f} | {min(res):.4f} | {args.numel / med / 1e9:.3f} | {paired(ds, res)} | "
            f"{paired(ds_copy, res)} |"
        )


if __name__ == "__main__":
    main()
