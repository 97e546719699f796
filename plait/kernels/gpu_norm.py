"""Exact-square float64 sum of squares on a GPU in one read of the tensor (Triton).

``plait.zero.clip.sum_squares64`` needs ``sum(x_i^2)`` with every square exact (a float32 or bf16 value
squared is exact in float64) and the sum in float64, so the offloaded and the device step derive the
same clip coefficient. Widening to float64 first reads 4 and writes 8 bytes per element, then reads 8 or
16 more; this kernel reads the 2 or 4 bytes once and widens in registers: each program sums BLOCK
elements into one float64 partial, and the partials are summed by torch (a fixed order for a given
length, so the result does not vary between runs).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: sum_squares64 keeps its torch path
    triton = None

BLOCK = 4096

if triton is not None:

    @triton.jit
    def _partial_sums(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float64)
        tl.store(out_ptr + pid, tl.sum(x * x, axis=0))


def available(x: torch.Tensor) -> bool:
    """Whether ``gpu_sum_squares64`` can take ``x``: a contiguous float32/bf16/fp16 CUDA tensor, Triton present."""
    return (
        triton is not None
        and x.is_cuda
        and x.is_contiguous()
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def gpu_sum_squares64(x: torch.Tensor) -> torch.Tensor:
    """``sum(x**2)`` over ``x`` (any shape, see ``available``) as a float64 0-dim tensor on its device, each
    square exact; one read of ``x``."""
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    partials = torch.empty(triton.cdiv(n, BLOCK), dtype=torch.float64, device=x.device)
    _partial_sums[(partials.numel(),)](x.reshape(-1), partials, n, BLOCK=BLOCK)
    return partials.sum()
