"""Host buffers backed by 2 MiB transparent huge pages, for the memory-bound CPU optimizer kernels.

An offloaded Adam step streams ~30 bytes per parameter through the CPUs (fp32 weights, gradient and two
moments read; weights and moments written; the bf16 copy written). With 4 KiB pages each of those six
streams needs a new address translation every 1024 elements (a TLB miss and a page walk); with 2 MiB
pages, one every 512 Ki elements. On the lent H200 host (16 cores, Linux THP in
"madvise" mode) plait's AdamW + bf16 copy-out went from 4.07 to 4.98 Gparams/s
(``benchmarks/results/offload_1xH200_session2.md``). Linux gives huge pages to anonymous memory only
where the process asks (``madvise(MADV_HUGEPAGE)``) unless THP is "always", and PyTorch's CPU allocator
asks only when ``THP_MEM_ALLOC_ENABLE=1`` is set for the whole process, so plait asks for its own
optimizer buffers here. Elsewhere (not Linux, THP "never", small buffers) these are plain
``torch.empty`` tensors: correctness never depends on huge pages.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14   # <linux/mman.h>


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def huge_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialized ``[numel]`` CPU tensor whose memory starts on a 2 MiB boundary and is advised for
    transparent huge pages (Linux); a plain ``torch.empty`` below one huge page or where that is not
    available. The advice applies before the first touch, so the pages come in huge when written."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    madvise = _madvise() if nbytes >= HUGE_PAGE else None
    if madvise is None:
        return torch.empty(numel, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % HUGE_PAGE
    madvise(raw.data_ptr() + off, nbytes, MADV_HUGEPAGE)   # best effort: an error only costs speed
    return raw[off:off + nbytes].view(dtype)


def huge_zeros(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``huge_empty`` filled with zeros."""
    return huge_empty(numel, dtype).zero_()
