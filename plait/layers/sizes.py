"""Sizes before allocation: a model's parameter counts without building its layers, and the refusal of a
build whose parameters alone exceed the memory of the device it is built on.

Every block of a ``TransformerModel`` has the same parameters, so the counts come from a meta-device build
of at most three layers (the embedding, one block, the head), whatever ``num_layers`` is. A build on the meta
device allocates nothing and is never refused; on the host the bound is its physical memory, on a GPU the
device's total memory (activations, gradients and optimizer states come on top: this catches only sizes no
run could hold, such as a hidden size of 10**9 in a config from elsewhere).
"""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import torch


def build_elements(config, mesh=None, layers: Sequence[int] | None = None, dtype=None) -> int:
    """Elements of the parameters this process would hold (its tp and ep share, vocabulary padding included)
    for the layers ``layers`` (default all: ``0 .. num_layers + 1``) of ``config``'s model. Counted on a meta
    build of the embedding, one block and the head whatever the number of blocks; a tied head built with the
    embedding counts nothing twice.

    Raises:
        ValueError: a tensor of these sizes would have 2**63 bytes or more (names the sizes).
    """
    from plait.layers.model import TransformerModel  # local: the model calls this module

    last = config.num_layers + 1
    indices = range(last + 1) if layers is None else sorted(set(layers))
    # sorted and unique: the blocks (0 < i < last) are one run, found by bisection, not by a walk over
    # num_layers entries (a config from elsewhere may ask for 10**6 blocks)
    lo, hi = bisect_right(indices, 0), bisect_left(indices, last)
    blocks, first_block = hi - lo, indices[lo] if hi > lo else None
    ends = {i for i in (0, last) if _holds(indices, i)}
    sample = sorted(ends | ({first_block} if blocks else set()))
    try:
        model = TransformerModel(config, mesh, layers=sample, device="meta", dtype=dtype)
    except (
        RuntimeError
    ) as e:  # torch: "Storage size calculation overflowed" (a tensor of 2**63 bytes or more)
        raise ValueError(
            f"the sizes hidden_size={config.hidden_size}, ffn_hidden_size={config.ffn_hidden_size}, "
            f"num_layers={config.num_layers}, vocab_size={config.vocab_size} give a tensor no device "
            f"can hold ({e}); fix these sizes"
        ) from None
    total = 0
    for name, p in model.named_parameters():
        total += p.numel() * (blocks if int(name.split(".")[1]) == first_block else 1)
    return total


def _holds(indices: Sequence[int], i: int) -> bool:
    """Whether the sorted ``indices`` hold ``i`` (by bisection)."""
    k = bisect_left(indices, i)
    return k < len(indices) and indices[k] == i


def memory_of(device: torch.device) -> int | None:
    """Bytes of memory of ``device``: the host's physical memory for ``cpu``, the total memory of a CUDA
    device; None where unknown."""
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return None


def check_build_fits(config, mesh, layers: Sequence[int], device, dtype) -> None:
    """Refuse, before anything is allocated, a build of ``layers`` of ``config`` on ``device`` (None: torch's
    default device) whose parameters alone need more bytes than the device has; a meta build always passes.

    Raises:
        ValueError: names the bytes needed and available, the device and the config's sizes.
    """
    device = torch.device(device) if device is not None else torch.empty(0).device
    available = None if device.type == "meta" else memory_of(device)
    if available is None:
        return
    elements = build_elements(config, mesh, layers, dtype)
    dtype = dtype or torch.get_default_dtype()
    need = elements * torch.empty(0, dtype=dtype, device="meta").element_size()
    if need > available:
        raise ValueError(
            f"TransformerModel on {device}: the parameters of layers {layers[0]}..{layers[-1]} need {need:.2e} "
            f"bytes ({elements:.2e} elements of {dtype}), more than the {available:.2e} bytes of memory {device} "
            f"has (hidden_size={config.hidden_size}, num_layers={config.num_layers}, vocab_size="
            f"{config.vocab_size}); fix these sizes, split the model over more ranks (tp, pp), or build it on "
            f"device='meta'"
        )
