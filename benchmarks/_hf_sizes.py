"""bench_hf_trainer.py's Llama sizes: the ``LlamaConfig`` of a size (``_offload_arm.SIZES``, vocabulary 32000;
tiny on the CPU with ``BENCH_SMOKE=1``), its parameter count, the random-weight checkpoint ``--largest`` loads,
and the host memory a ZeRO-3 + offload run of it needs over ``nproc`` processes of one node (the guard that
skips a size rather than trying it)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _offload_arm import SIZES
from _trainer import SHAPE, SMOKE
from bench_offload import HOST_BYTES_PER_PARAM

# --largest: bench_offload's Llama sizes and host bytes per parameter under ZeRO-3 + full offload
HOST_BYTES = HOST_BYTES_PER_PARAM
if SMOKE:
    SIZES = {k: (32, 2, 4, 2, 64) for k in SIZES}


def parameter_count(size: str) -> float:
    """Parameters of ``size`` without the norms (``n (2 h^2 (1 + kv/heads) + 3 h ffn) + 2 V h``, V = 32000
    untied): 68.975B for ``70b`` against 68.977B counted on ``LlamaForCausalLM`` on the meta device."""
    h, n, heads, kv, ffn = SIZES[size]
    return n * (2 * h * h * (1 + kv / heads) + 3 * h * ffn) + 2 * 32000 * h


def llama_shape(size: str) -> dict:
    """The LlamaConfig fields of bench_offload's size ``size``."""
    h, n, heads, kv, ffn = SIZES[size]
    shape = dict(SHAPE)
    shape.update(
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=ffn,
    )
    return shape


def write_checkpoint(folder: str, size: str) -> None:
    """A Hugging Face Llama checkpoint of ``size`` with random bf16 weights (std 0.02, norms 1), written
    tensor by tensor into safetensors shards of at most 2 GB with their index: the host never holds more
    than one shard."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from plait.zero import meta_parameters

    config = transformers.LlamaConfig(**llama_shape(size), torch_dtype="bfloat16")
    with meta_parameters():
        names = [(n, p.shape) for n, p in transformers.LlamaForCausalLM(config).named_parameters()]
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(0)
    shard, shard_bytes, weight_map, files = {}, 0, {}, []

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))

    for n, shape in names:
        t = (
            torch.ones(shape)
            if "norm" in n
            else torch.randn(shape, generator=gen, device=dev).mul_(0.02)
        )
        if shard and shard_bytes + t.numel() * 2 > 2 * 2**30:
            flush()
            shard, shard_bytes = {}, 0
        shard[n] = t.to(torch.bfloat16).cpu()
        shard_bytes += t.numel() * 2
    flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if dev == "cuda":  # the arm's process gets the GPU: this one keeps only its CUDA context
        torch.cuda.empty_cache()


def host_bytes_per_param(fw: str, state_dtype: str) -> float:
    """Host bytes per host-side parameter under ZeRO-3 + offload: bench_offload's fp32-moment figure with the
    two moments (8 bytes) stored in ``state_dtype`` instead (``plait.fit.plan.moment_bytes``)."""
    from plait.fit.plan import moment_bytes

    return HOST_BYTES[fw] - 8 + moment_bytes(2**20, state_dtype) / 2**20


def host_need_gib(fw: str, size: str, on_host: float, state_dtype: str, nproc: int) -> float:
    """Host GiB a ZeRO-3 run of ``size`` needs on one node of ``nproc`` ranks: the host-side states (sharded
    over the ranks, so their sum does not grow with ``nproc``; ``on_host`` of them: 1 under full offload, the
    ratio under GPU-first) plus each rank's own process (``plait.fit.PROCESS_BASELINE_BYTES`` and the CPU
    optimizer's runtime, ``CPU_OPTIMIZER_RUNTIME_BYTES``), which multiply with ``nproc``."""
    from plait.fit import CPU_OPTIMIZER_RUNTIME_BYTES, PROCESS_BASELINE_BYTES

    states = parameter_count(size) * host_bytes_per_param(fw, state_dtype) * on_host
    return (states + nproc * (PROCESS_BASELINE_BYTES + CPU_OPTIMIZER_RUNTIME_BYTES)) / 2**30
