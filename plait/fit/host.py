"""The host side of a run's peak (VmHWM, the process's peak resident set), term by term.

    host peak = process + CPU optimizer runtime + max(model build copy, host states)

* process (:data:`PROCESS_BASELINE_BYTES`): Python, torch and its CUDA libraries, the CUDA context's host side,
  the loaded GPU kernels, NCCL: what a training process holds besides its tensors. Measured once: the first
  plait record of ``benchmarks/results/offload_1xH200_session2.md`` (``bench_offload.py --part a``: plait's own
  886M Llama built on the GPU, ZeRO-2 + offload_optimizer, pin_memory; nothing else on the host) minus its 16 B
  per parameter of states and the runtime below.
* CPU optimizer runtime (:data:`CPU_OPTIMIZER_RUNTIME_BYTES`, with ``offload_optimizer``): numba, llvmlite and
  the compiled kernels (``plait.kernels``); ``benchmarks/probe_host_runtime.py`` on the CPU, kernels compiled
  into an empty cache.
* model build copy (``Settings.model_build``): a model built from its config on the host holds every parameter
  in fp32 (4 B/param; ``transformers.LlamaForCausalLM(config)``) until ``plait.initialize`` moves it to the GPU
  (``plait.engine.model.on_device``: ``model.to(device)``, parameter by parameter, before ZeRO allocates
  anything), so it and the states peak apart; ``plait.hf.from_pretrained`` (meta parameters, checkpoint slices
  read per segment: ``plait.zero.weights.SafetensorsWeights.read``) and models built on the GPU hold none.
* host states: the plan's rows (``plait.fit.plan``): fp32 masters (``plait.zero.build.materialize``), gradient
  shards (``ZeroOptimizer._build_masters``, page-locked at their exact size: ``plait.zero.pinned.host_empty``),
  Adam moments (``plait.kernels.CPUAdam`` / ``CPUAdamStates``), the bf16 copy-out buffers
  (``plait.zero.offload.copyback.CopyBack``: one per flat group, the groups the placement keeps on the GPU
  included) and, with offload_param, the bf16 parameter shards (``materialize``: ``to_host``).

Left out, each below 0.1 GiB in the recorded runs: the landing's staging buffers (only where the reduced
gradient's dtype differs from the shard's, one segment at a time: ``plait.zero.offload.landing``), the weight
reader's per-segment slices, the Trainer's batches (its DataLoader workers are processes of their own). The
stage-3 gatherer and the device share allocate on the GPU only.
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


def host_terms(params: int, offload_optimizer: bool, model_build: str) -> tuple[tuple[str, int], ...]:
    """The terms besides the host states, ``(name, bytes)``: the process, the CPU optimizer runtime and the
    model build copy (module docstring). Raises ValueError: an unknown ``model_build``."""
    if model_build not in BUILD_BYTES_PER_PARAM:
        raise ValueError(f"model_build={model_build!r} must be one of {sorted(BUILD_BYTES_PER_PARAM)}")
    return (("process (Python, torch, CUDA libraries)", PROCESS_BASELINE_BYTES),
            ("CPU optimizer runtime (numba kernels)", CPU_OPTIMIZER_RUNTIME_BYTES if offload_optimizer else 0),
            (f"model build copy ({model_build}, before the states)",
             BUILD_BYTES_PER_PARAM[model_build] * params))


def host_peak(terms: tuple[tuple[str, int], ...], states: int) -> int:
    """The host peak: the process and runtime terms, plus the larger of the build copy (the last term) and the
    host ``states`` (they are never held together)."""
    *always, (_, build) = terms
    return sum(b for _, b in always) + max(build, states)
