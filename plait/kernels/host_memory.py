"""Host buffers that forked processes do not inherit.

A process forked while the optimizer's host state exists (a ``DataLoader`` worker, started at every epoch
unless ``persistent_workers``) shares those pages copy-on-write: while the child lives, the first write of
each page by the parent copies it, which turns the next host optimizer step over tens of GB into seconds
of page faults. ``madvise(MADV_DONTFORK)`` (Linux) leaves such a buffer out of every child's address
space instead; the children never touch plait's optimizer state.

Only buffers of at least ``MIN_BYTES`` are marked (glibc serves those with a mapping of their own: its
largest mmap threshold is 32 MiB), and the mark is taken back (``MADV_DOFORK``) when the tensor is
garbage-collected, so memory an allocator (jemalloc, tcmalloc) later hands to another allocation is
inherited as usual. The partial pages at the two ends are left as they are.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import weakref

import torch

MIN_BYTES = 64 * 2**20
MADV_DONTFORK, MADV_DOFORK = 10, 11

log = logging.getLogger("plait")


def keep_from_children(t: torch.Tensor) -> torch.Tensor:
    """Mark the whole pages of the contiguous CPU tensor ``t`` ``MADV_DONTFORK`` and return ``t``; a no-op
    for smaller tensors, elsewhere than Linux, or when the kernel refuses (the buffer then stays inheritable,
    which costs time after a fork, never correctness in this process). The mark lasts while the object
    ``t`` lives: pass the long-lived tensor (the ``nn.Parameter``, not a temporary it is made from)."""
    nbytes = t.numel() * t.element_size()
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or nbytes < MIN_BYTES:
        return t
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + nbytes) // page * page
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTFORK) != 0:
        log.debug(
            "madvise(MADV_DONTFORK) of %d bytes refused (errno %d)", end - start, ctypes.get_errno()
        )
        return t
    weakref.finalize(
        t, libc.madvise, ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DOFORK
    )
    return t
