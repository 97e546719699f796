"""What the checkpoint storage tests share (test_checkpoint_format.py, test_checkpoint_safety.py)."""

import torch


def full(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    """The same logical tensor on every process: seeded by its name."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*shape, generator=g).to(dtype)
