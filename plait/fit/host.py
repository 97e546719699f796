"""The host side of a run's peak (VmHWM, the process's peak resident set), term by term, in bytes.

    host peak = process + CPU optimizer runtime + max(model build copy, host states)

:data:`PROCESS_BASELINE_BYTES` (Python, torch, CUDA and NCCL libraries; measured in
``benchmarks/results/offload_1xH200_session2.md``), :data:`CPU_OPTIMIZER_RUNTIME_BYTES` (numba and the
compiled kernels, with ``offload_optimizer``; ``benchmarks/probe_host_runtime.py``), the fp32 copy of a model
built on the host (``Settings.model_build``), and the plan's host states (``plait.fit.plan``). What each
term holds, and what is left out (each below 0.1 GiB in the recorded runs): ``docs/fit.md``.
"""

from __future__ import annotations

#: Host bytes of the training process besides its tensors and the CPU optimizer runtime: 15,764,348,928 bytes
#: VmHWM (14.68 GiB) of the first plait row of ``results/offload_1xH200_session2.md`` (1 x H200, torch
#: 2.11.0+cu130) minus 16 x 886,114,304 bytes of states and :data:`CPU_OPTIMIZER_RUNTIME_BYTES`.
PROCESS_BASELINE_BYTES = 1_506_914_304
#: numba, llvmlite and plait's compiled CPU kernels: VmHWM of a tiny offloaded ZeRO-2 run minus the same run
#: without offload, kernels compiled into an empty cache (``benchmarks/probe_host_runtime.py``, runtime_cold).
CPU_OPTIMIZER_RUNTIME_BYTES = 79_519_744
#: Bytes per parameter a model build leaves on the host until ``plait.initialize`` moves it to the GPU.
BUILD_BYTES_PER_PARAM = {"none": 0, "fp32": 4}


def host_terms(
    params: int, offload_optimizer: bool, model_build: str
) -> tuple[tuple[str, int], ...]:
    """The terms besides the host states, ``(name, bytes)``: the process, the CPU optimizer runtime and the
    model build copy (module docstring). Raises ValueError: an unknown ``model_build``."""
    if model_build not in BUILD_BYTES_PER_PARAM:
        raise ValueError(
            f"model_build={model_build!r} must be one of {sorted(BUILD_BYTES_PER_PARAM)}"
        )
    return (
        ("process (Python, torch, CUDA libraries)", PROCESS_BASELINE_BYTES),
        (
            "CPU optimizer runtime (numba kernels)",
            CPU_OPTIMIZER_RUNTIME_BYTES if offload_optimizer else 0,
        ),
        (
            f"model build copy ({model_build}, before the states)",
            BUILD_BYTES_PER_PARAM[model_build] * params,
        ),
    )


def host_peak(terms: tuple[tuple[str, int], ...], states: int) -> int:
    """The host peak: the process and runtime terms, plus the larger of the build copy (the last term) and the
    host ``states`` (they are never held together)."""
    *always, (_, build) = terms
    return sum(b for _, b in always) + max(build, states)
