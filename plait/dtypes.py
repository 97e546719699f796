"""Dtype names: the one table from the names users write ("bf16", "float16", "fp32", ...) to torch dtypes.

Imports only torch, so configuration, checkpoint and ZeRO code can all use it without import cycles.
"""

from __future__ import annotations

import torch

#: Accepted dtype names (lower case) -> torch dtype.
DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}


def dtype_from_name(name: str) -> torch.dtype:
    """``"bf16"`` / ``"BFloat16"`` -> ``torch.bfloat16`` (case-insensitive, see :data:`DTYPE_NAMES`).

    Raises:
        ValueError: an unknown name; the message lists the accepted names.
    """
    key = str(name).lower()
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[key]


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype name or ``torch.dtype`` -> ``torch.dtype``; None stays None (ValueError for unknown names)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    return dtype_from_name(value)


def cast_floating(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` when both are given and ``t`` is floating; integer tensors and ``dtype=None``
    leave ``t`` unchanged (no copy)."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t
