"""The engine's random-number generators as a checkpoint keeps them (``plait.checkpoint.RngState``): torch's
CPU generator, the current CUDA device's, and the tensor-parallel RNG tracker of each model chunk that has
one (a plait model's ``rng``, ``plait.parallel.random``)."""
from __future__ import annotations

import torch
from torch import nn

from plait.checkpoint.contract import RngState


def rng_state(chunks: list[nn.Module], device: torch.device) -> RngState:
    """The generators' states now (the CUDA one only when ``device`` is a GPU)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and device.type == "cuda" else None
    trackers = {i: chunk.rng.get_states() for i, chunk in enumerate(chunks) if getattr(chunk, "rng", None) is not None}
    return RngState(torch.get_rng_state(), cuda, trackers)


def load_rng_state(chunks: list[nn.Module], device: torch.device, state: RngState) -> None:
    """Set the generators to ``state`` (a tracker's only where ``state`` holds that chunk's)."""
    torch.set_rng_state(state.cpu)
    if state.cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state.cuda)
    for i, chunk in enumerate(chunks):
        if getattr(chunk, "rng", None) is not None and i in state.trackers:
            chunk.rng.set_states(state.trackers[i])
