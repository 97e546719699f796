"""Page-locked host buffers of exactly the size asked for.

ZeRO-Offload's host buffers (gradient shards, bf16 copy-out, stage-3 parameter shards) must be
page-locked ("pinned") so device<->host copies are asynchronous DMA. ``torch.empty(...,
pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every request up to a
power of two (``CachingHostAllocator``: "round up the allocation to the nearest power of two to
improve reuse"): an 18 GB gradient shard pins 32 GB, which is what limited the largest model that fits
in host memory. Large buffers here are allocated pageable and then registered with the CUDA driver
(``cudaHostRegister``), which pins exactly their pages; the registration is undone when the returned
tensor is garbage-collected (views that outlive it keep valid, merely pageable, memory). Small
buffers keep using the caching allocator, whose rounding costs little there. Large buffers are not
inherited by forked processes (``plait.kernels.host_memory``).
"""

from __future__ import annotations

import weakref

import torch

from plait.kernels.host_memory import keep_from_children

REGISTER_MIN_BYTES = (
    64 * 2**20
)  # below this, torch's caching pinned allocator (power-of-two rounding)


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """``[numel]`` host tensor of ``dtype``, page-locked when ``pin`` and CUDA is available.

    Raises:
        RuntimeError: the driver refused to page-lock the buffer (names the size and the CUDA error).
    """
    if not (pin and torch.cuda.is_available()):
        return keep_from_children(torch.empty(numel, dtype=dtype))
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < REGISTER_MIN_BYTES:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    t = keep_from_children(torch.empty(numel, dtype=dtype))
    pin_existing(t)
    return t


def pin_existing(t: torch.Tensor) -> None:
    """Page-lock the memory of the contiguous CPU tensor ``t`` in place (no copy), until ``t`` is
    garbage-collected; a no-op without CUDA or when that memory is already page-locked.

    Raises:
        RuntimeError: the driver refused (names the size and the CUDA error).
    """
    if not torch.cuda.is_available() or t.is_pinned() or t.numel() == 0:
        return
    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of a {nbytes / 2**30:.2f} GiB host buffer failed: "
            f"{cudart.cudaGetErrorString(err)}; free host memory, raise the locked-memory limit "
            "(ulimit -l), or set offload pin_memory false"
        )
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A flat host copy of ``t`` (``[t.numel()]``, same dtype), page-locked as in :func:`host_empty`."""
    out = host_empty(t.numel(), t.dtype, pin)
    out.copy_(t.reshape(-1))
    return out
