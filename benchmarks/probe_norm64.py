"""Probe: cost of the float64 gradient norm on one GPU (886M float32 elements, as llama-886m's gradient).

    python benchmarks/probe_norm64.py

Compares torch's float32 norm (what the non-offloaded step used before), the chunked float64 dot, plait's
one-read Triton kernel (``plait.kernels.gpu_norm``, what ``clip.sum_squares64`` uses on a GPU) and
``torch.linalg.vector_norm(dtype=float64)``; prints ms per call (median of 20, CUDA events), the relative
difference of each result from an exact reference (float64 copy) and the extra memory. Then checks the
Triton kernel against the exact reference on odd sizes and float32/bf16/fp16 inputs (fresh random data).
"""

import statistics
import sys

import torch

sys.path.insert(0, ".")
from plait.kernels.gpu_norm import gpu_sum_squares64  # noqa: E402


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    n = 886_000_000
    g = torch.randn(n, device="cuda") * 1e-3
    exact = float(torch.dot(g.double(), g.double()))
    arms = {
        "float32 pow(2).sum()": lambda: g.pow(2).sum(),
        "chunked float64 dot (8M at a time)": lambda: sum(
            torch.dot(c, c) for c in (w.double() for w in g.split(1 << 23))
        ),
        "plait gpu_sum_squares64 (Triton)": lambda: gpu_sum_squares64(g),
        "vector_norm(dtype=float64) ** 2": lambda: (
            torch.linalg.vector_norm(g, 2, dtype=torch.float64) ** 2
        ),
    }
    print(f"device: {torch.cuda.get_device_name(0)}; {n / 1e6:.0f}M float32 elements")
    for name, fn in arms.items():
        ms = bench(fn)
        rel = abs(float(fn()) - exact) / exact
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(f"{name:40s} {ms:7.3f} ms   rel diff {rel:.1e}   extra memory {extra:.0f} MiB")
    worst = 0.0
    for size in (1, 4095, 4096, 4097, 1_000_003, 33_554_433):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(size, device="cuda") * 3).to(dtype)
            want = float(torch.dot(x.double(), x.double()))
            worst = max(worst, abs(float(gpu_sum_squares64(x)) - want) / want)
    print(
        f"Triton kernel vs exact float64, sizes 1..33.5M, fp32/bf16/fp16: worst rel diff {worst:.1e}"
    )
    assert worst < 1e-13, worst


if __name__ == "__main__":
    main()
