"""Say what fits before allocating (issue 43.4): the bytes a training run of a dense Llama-style model holds on
one GPU and its host, the placement of each state, the largest model of the same widths that fits, and the
engine's refusal of a run that clearly does not (``plait estimate-memory``; ``plait.fit.check``)."""

from plait.fit.activations import activation_peak, block_bytes_per_token, loss_bytes_per_token
from plait.fit.host import CPU_OPTIMIZER_RUNTIME_BYTES, PROCESS_BASELINE_BYTES
from plait.fit.plan import (
    ALLOCATOR_SLACK_BYTES,
    CUDA_CONTEXT_BYTES,
    Plan,
    Settings,
    estimate,
    fixes,
    largest_fitting,
)
from plait.fit.shape import ModelShape, preset_shape, read_hf_shape, shape_from_hf

__all__ = [
    "ALLOCATOR_SLACK_BYTES",
    "CPU_OPTIMIZER_RUNTIME_BYTES",
    "CUDA_CONTEXT_BYTES",
    "PROCESS_BASELINE_BYTES",
    "ModelShape",
    "Plan",
    "Settings",
    "activation_peak",
    "block_bytes_per_token",
    "estimate",
    "fixes",
    "largest_fitting",
    "loss_bytes_per_token",
    "preset_shape",
    "read_hf_shape",
    "shape_from_hf",
]
