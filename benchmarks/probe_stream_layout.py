"""Which loop shape lets numba stream Adam's bytes as fast as the host allows? (diagnostic)

Runs the same AdamW + bf16 copy-out update over --numel float32 elements in four loop shapes, each
--steps times on --threads numba threads, and DeepSpeedCPUAdam when importable:

* ``flat``: ``prange`` over elements (numba splits the range into one contiguous block per thread);
* ``window-K``: the range cut into chunks of K elements, thread t doing chunks t, t+T, t+2T, ... so
  all threads stream through a moving window (as an OpenMP loop inside a tile does);
* ``blocks-K``: per-thread contiguous blocks, processed K elements at a time (inner ``range``).

    python benchmarks/probe_stream_layout.py --numel 200e6 --threads 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
import torch
from numba import njit, prange

from plait.kernels.lowp import bf16_bits


@njit(inline="always", error_model="numpy")
def _upd(p, g, m, v, out, i, b1, b2, eps, step, decay):
    gi = g[i]
    mi = b1 * m[i] + (np.float32(1) - b1) * gi
    vi = b2 * v[i] + (np.float32(1) - b2) * gi * gi
    w = p[i] * decay - step * (mi / (np.sqrt(vi) + eps))
    m[i] = mi
    v[i] = vi
    p[i] = w
    out[i] = bf16_bits(w, np.uint16(0xFFFF))


@njit(nogil=True, cache=True, error_model="numpy")
def _span(p, g, m, v, out, b1, b2, eps, step, decay):
    for i in range(p.shape[0]):
        _upd(p, g, m, v, out, i, b1, b2, eps, step, decay)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def flat(p, g, m, v, out, b1, b2, eps, step, decay):
    for i in prange(p.shape[0]):
        _upd(p, g, m, v, out, i, b1, b2, eps, step, decay)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def window(p, g, m, v, out, b1, b2, eps, step, decay, chunk, threads):
    n = p.shape[0]
    nchunks = (n + chunk - 1) // chunk
    for t in prange(threads):
        for c in range(t, nchunks, threads):
            s, e = c * chunk, min(n, (c + 1) * chunk)
            _span(p[s:e], g[s:e], m[s:e], v[s:e], out[s:e], b1, b2, eps, step, decay)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def blocks(p, g, m, v, out, b1, b2, eps, step, decay, chunk, threads):
    n = p.shape[0]
    per = (n + threads - 1) // threads
    for t in prange(threads):
        lo, hi = t * per, min(n, (t + 1) * per)
        for s in range(lo, hi, chunk):
            e = min(hi, s + chunk)
            _span(p[s:e], g[s:e], m[s:e], v[s:e], out[s:e], b1, b2, eps, step, decay)


def timed(fn, steps):
    fn()
    fn()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out), min(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=lambda s: int(float(s)), default=200_000_000)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    n, th = args.numel, args.threads
    numba.set_num_threads(th)
    torch.set_num_threads(th)
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    out = torch.empty(n, dtype=torch.bfloat16)
    a = [x.numpy() for x in (p, g, m, v)] + [out.view(torch.int16).numpy().view(np.uint16)]
    f = np.float32
    hp = (f(0.9), f(0.95), f(1e-8), f(1e-4), f(0.99999))
    shapes = {"flat": lambda: flat(*a, *hp)}
    for k in (4096, 65536, 1 << 20):
        shapes[f"window-{k}"] = lambda k=k: window(*a, *hp, k, th)
        shapes[f"blocks-{k}"] = lambda k=k: blocks(*a, *hp, k, th)
    print(
        f"numel={n:,} threads={th}\n| loop shape | median s | best s | Gparams/s (median) |\n|---|---:|---:|---:|"
    )
    for name, fn in shapes.items():
        med, best = timed(fn, args.steps)
        print(f"| {name} | {med:.4f} | {best:.4f} | {n / med / 1e9:.3f} |", flush=True)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        q = torch.nn.Parameter(torch.randn(n))
        q.grad = torch.randn(n)
        opt = DeepSpeedCPUAdam([q], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, adamw_mode=True)
        med, best = timed(opt.step, args.steps)
        print(f"| DeepSpeedCPUAdam | {med:.4f} | {best:.4f} | {n / med / 1e9:.3f} |")
    except ImportError:
        print("| DeepSpeedCPUAdam | not installed | | |")


if __name__ == "__main__":
    main()
