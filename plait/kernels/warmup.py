"""Compile the CPU optimizer kernels ahead of the first training step and report how long it took.

Numba compiles a kernel on its first call (about 1-5 s each on one core for the parallel kernels,
some 10-15 s for all of them). Every kernel is declared with ``cache=True``, so the machine code is
also written to numba's on-disk cache (``__pycache__`` next to the module, or ``NUMBA_CACHE_DIR``) and
later processes, such as the other ranks and every later run, load it instead (about 0.1 s a kernel;
the first parallel call also starts numba's thread pool). Editing a kernel's source invalidates its
entry. Call :func:`compile_kernels` once at start-up, before timing anything, so the first optimizer
step is not charged with compilation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from plait.kernels import cpu_adam, cpu_adam_states, cpu_lion, lowp
from plait.kernels.cpu_adam import CPUAdam
from plait.kernels.cpu_adam_states import CPUAdamStates
from plait.kernels.cpu_lion import CPULion
from plait.kernels.lowp import copy_to_lowp

KERNELS = (
    cpu_adam.adam_kernel,
    cpu_adam_states.adam_bf16_kernel,
    cpu_adam_states.adam_int8_kernel,
    cpu_lion.lion_kernel,
    lowp._convert,
)


@dataclass(frozen=True)
class CompileReport:
    """What :func:`compile_kernels` did.

    Attributes:
        seconds: ``{"adam", "adam_bf16", "adam_int8", "lion", "lowp"}`` -> wall seconds of the first calls (compile or
            cache load, plus tiny 64-element steps in the three copy-out modes).
        total_s: their sum, seconds.
        compiled: kernel signatures compiled in this call (0: everything came from the on-disk cache
            or was already loaded in this process).
        cache_dir: where numba keeps the cached machine code.
    """

    seconds: dict
    total_s: float
    compiled: int
    cache_dir: str


def _misses() -> int:
    return sum(sum(k.stats.cache_misses.values()) for k in KERNELS)


def compile_kernels(num_threads: int | None = None) -> CompileReport:
    """Compile (or load from the on-disk cache) every kernel in every copy-out mode; see :class:`CompileReport`.

    Args:
        num_threads: numba threads for the warm-up calls (None: all).
    """
    n = 64
    before = _misses()
    seconds: dict[str, float] = {}
    outs = (None, torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.float16))
    makers = {
        "adam": lambda: CPUAdam(n, num_threads=num_threads),
        "adam_bf16": lambda: CPUAdamStates(n, num_threads=num_threads, state_dtype="bf16"),
        "adam_int8": lambda: CPUAdamStates(n, num_threads=num_threads, state_dtype="int8"),
        "lion": lambda: CPULion(n, num_threads=num_threads),
    }
    for name, make in makers.items():
        opt = make()
        p, g = torch.randn(n), torch.randn(n)
        t0 = time.perf_counter()
        for out in outs:
            opt.step(p, g, out)
        seconds[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for out in outs[1:]:
        copy_to_lowp(torch.randn(n), out)
    seconds["lowp"] = time.perf_counter() - t0
    return CompileReport(
        seconds=seconds,
        total_s=sum(seconds.values()),
        compiled=_misses() - before,
        cache_dir=str(KERNELS[0].stats.cache_path),
    )
