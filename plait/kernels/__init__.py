"""Hot loops: numba CPU optimizers for ZeRO-Offload, fused with the bf16/fp16 parameter copy-out.

``CPUAdam`` (Adam/AdamW), ``CPUAdamStates`` (its moments in bf16 or 8-bit blocks, ``quant``) and ``CPULion`` step a flat float32 host buffer in one pass, optionally
writing the updated bf16/fp16 weights; ``copy_to_lowp`` is the stand-alone conversion;
``compile_kernels`` compiles them up front (or loads numba's on-disk cache) and reports the seconds it
took. LAMB has no host kernel: the engine refuses it with ``offload_optimizer``.
"""

from plait.kernels.cpu_adam import CPUAdam
from plait.kernels.cpu_adam_states import CPUAdamStates
from plait.kernels.cpu_lion import CPULion
from plait.kernels.lowp import copy_to_lowp
from plait.kernels.warmup import CompileReport, compile_kernels

__all__ = [
    "CPUAdam",
    "CPUAdamStates",
    "CPULion",
    "CompileReport",
    "compile_kernels",
    "copy_to_lowp",
]
