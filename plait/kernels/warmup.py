"""Compile the CPU optimizer kernels ahead of the first training step and report how long it took.

Numba compiles a kernel on its first call (about 1-10 s each on one core for the parallel kernels).
Every kernel is declared with ``cache=True``, so the machine code is also written to numba's on-disk
cache (``__pycache__`` next to the module, or ``NUMBA_CACHE_DIR``) and later processes, such as the
other ranks and every later run, load it in well under a second. Call :func:`compile_kernels` once at
start-up (before timing anything) so the first optimizer step is not charged with compilation.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from plait.kernels.cpu_adam import CPUAdam
from plait.kernels.cpu_lamb import CPULAMB
from plait.kernels.cpu_lion import CPULion
from plait.kernels.lowp import copy_to_lowp


def compile_kernels(num_threads: int | None = None) -> dict[str, float]:
    """Compile (or load from the on-disk cache) every kernel in every copy-out mode.

    Args:
        num_threads: numba threads for the warm-up calls (None: all).

    Returns:
        ``{"adam", "lion", "lamb", "lowp", "total"}`` -> wall seconds of each first call (compile or
        cache load plus a 64-element step). A second call in the same process returns ~0 for each.
    """
    n = 64
    times: dict[str, float] = {}
    outs = (None, torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.float16))
    makers = {
        "adam": lambda: CPUAdam(n, num_threads=num_threads),
        "lion": lambda: CPULion(n, num_threads=num_threads),
        "lamb": lambda: CPULAMB(n, np.array([0, 16, n]), num_threads=num_threads),
    }
    for name, make in makers.items():
        opt = make()
        p, g = torch.randn(n), torch.randn(n)
        t0 = time.perf_counter()
        for out in outs:
            opt.step(p, g, out)
        times[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for out in outs[1:]:
        copy_to_lowp(torch.randn(n), out)
    times["lowp"] = time.perf_counter() - t0
    times["total"] = sum(times.values())
    return times
