"""Where each optimizer state lives under ZeRO-Offload: the GPU first, the host for the rest.

ZeRO-Offload (Ren et al., USENIX ATC'21, Sec. 4) moves all of a rank's fp32 master weights and Adam moments
(12 bytes per parameter) to host memory; host memory then bounds the model (16 bytes per parameter with the
gradient shard) while most of the GPU stays empty. DeepSpeed's partial offload (``offload_optimizer.ratio``,
ZeRO-3) keeps a share on the GPU. Here ``OffloadOptions.ratio = r`` keeps the states of the first ``1 - r``
of the partition, in forward order, resident in device memory: their gradients never leave the device and
the device steps them (``DeviceShare``, bit-identical to the host kernels); the host holds the rest.

The unit of placement is a parameter (ZeRO stages 1-2) or a ZeRO-3 unit (all parameters gathered together
share one flat group); a parameter marked resident gets a flat group of its own (``GroupKey.resident``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def resident_params(blocks: Sequence[Iterable[torch.nn.Parameter]], ratio: float) -> set[int]:
    """ids of the parameters whose optimizer states stay on the device.

    Args:
        blocks: the units of placement in forward order (each an iterable of parameters placed together).
        ratio: the fraction of elements on the host (``OffloadOptions.ratio``).

    Returns:
        The ids of every parameter of the leading blocks that hold together at most ``1 - ratio`` of all
        elements (rounded to whole blocks: a block is resident while the resident elements stay within it).
    """
    blocks = [list(b) for b in blocks]
    total = sum(p.numel() for b in blocks for p in b)
    budget, placed, out = (1.0 - ratio) * total, 0, set()
    for block in blocks:
        size = sum(p.numel() for p in block)
        if placed + size > budget:
            break
        placed += size
        out.update(id(p) for p in block)
    return out


def placement_blocks(
    named: Sequence[tuple[str, torch.nn.Parameter]], units
) -> list[list[torch.nn.Parameter]]:
    """The units of placement in forward order: each ZeRO-3 unit's parameters (``units``: its ``Unit`` s, in
    forward order), then every parameter outside a unit; below stage 3 (``units`` empty) each parameter in
    registration order (a proxy for forward order, as ``ready.forward_order``)."""
    in_unit = {id(p) for u in units for p in u.params}
    blocks = [[p for p in u.params] for u in units]
    return blocks + [[p] for _, p in named if id(p) not in in_unit]
