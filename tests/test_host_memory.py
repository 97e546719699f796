"""``plait.kernels.host_memory.keep_from_children``: a forked process does not inherit a marked buffer, so
the parent's writes after the fork stay in place (no copy-on-write). Asserted through what the child can
read: a marked buffer is absent from its address space (reading it kills the child with SIGSEGV), an
unmarked one is readable. A small buffer is never marked (its pages may be shared with other allocations)."""

import faulthandler
import multiprocessing as mp
import os
import signal
import sys

import pytest
import torch

from plait.kernels.host_memory import MIN_BYTES, keep_from_children

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="MADV_DONTFORK is Linux's"
)


def _read_middle(t):
    faulthandler.disable()  # the expected SIGSEGV needs no traceback
    os._exit(0 if float(t[t.numel() // 2]) == 3.0 else 1)


def _child_exit(t) -> int:
    p = mp.get_context("fork").Process(target=_read_middle, args=(t,))
    p.start()
    p.join(60)
    return p.exitcode


def test_a_marked_buffer_is_not_in_a_forked_child():
    t = keep_from_children(torch.full((MIN_BYTES // 4,), 3.0))
    assert _child_exit(t) == -signal.SIGSEGV
    assert (
        float(t[t.numel() // 2]) == 3.0 and float(t.sum()) == 3.0 * t.numel()
    )  # the parent's own is intact


def test_unmarked_and_small_buffers_are_inherited():
    assert _child_exit(torch.full((MIN_BYTES // 4,), 3.0)) == 0
    assert _child_exit(keep_from_children(torch.full((MIN_BYTES // 4 - 1024,), 3.0))) == 0
