"""Layout-invariant initialization.

Each parameter's *whole logical* tensor is drawn from a generator seeded by
``(seed, logical parameter name)``, and each rank keeps its slice (``TPShard.shard``), so
a model built at tp=1 and at tp=4 (or cut into any pipeline stages) starts with identical
logical weights. Layers declare how to initialize a parameter with ``set_init``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from plait.parallel.sharding import logical_parts

INIT_ATTR = "plait_init"
TIED_ATTR = "plait_tied_to"


def set_init(param: nn.Parameter, kind: str, std: float = 0.0) -> nn.Parameter:
    """Declare ``param``'s initializer: ``"normal"`` (mean 0, ``std``), ``"zeros"`` or ``"ones"``."""
    if kind not in ("normal", "zeros", "ones"):
        raise ValueError(f"unknown init kind {kind!r}; use 'normal', 'zeros' or 'ones'")
    setattr(param, INIT_ATTR, (kind, std))
    return param


def seed_for(seed: int, name: str) -> int:
    """A 63-bit generator seed from ``(seed, name)``, stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int) -> None:
    """Initialize every parameter of ``module`` from its logical name (see the module docstring).

    A fused parameter (``FusedShard``) initializes each logical tensor it holds from that tensor's
    name, as the unfused layers would. A parameter that mirrors another (``plait_tied_to``, e.g. the
    output head tied to the input embedding on another pipeline stage) is seeded with the other's
    name, so the two copies start equal. Parameters on the meta device are skipped.

    Raises:
        ValueError: a parameter has no declared initializer.
    """
    for name, param in module.named_parameters():
        if param.is_meta:
            continue
        kind, std = getattr(param, INIT_ATTR, (None, 0.0))
        if kind is None:
            raise ValueError(
                f"parameter {name} has no initializer; call plait.layers.init.set_init on it"
            )
        for part in logical_parts(getattr(param, TIED_ATTR, name), param):
            _init_part(part.local(param), part.spec, kind, std, seed, part.name)


def _init_part(local: torch.Tensor, spec, kind: str, std: float, seed: int, name: str) -> None:
    """Fill ``local``, this rank's shard ``spec`` of logical tensor ``name``."""
    if kind == "zeros":
        local.zero_()
        return
    if kind == "ones":
        # Padding rows (vocab) stay zero: build the logical tensor, then shard it.
        local.copy_(
            spec.shard(torch.ones(spec.logical_shape, dtype=local.dtype, device=local.device))
        )
        return
    gen = torch.Generator(device=local.device)
    gen.manual_seed(seed_for(seed, name))
    full = torch.empty(spec.logical_shape, dtype=torch.float32, device=local.device)
    full.normal_(0.0, std, generator=gen)
    local.copy_(spec.shard(full).to(local.dtype))
