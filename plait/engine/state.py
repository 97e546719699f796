"""The engine's state a checkpoint keeps beside the model and the optimizer: the trainer state
(``plait.checkpoint.TrainerState``: samples so far, the schedule's and the data loader's states, the resolved
config) and the random-number generators (``plait.checkpoint.RngState``): torch's CPU generator, the current
CUDA device's, and the tensor-parallel RNG tracker of each model chunk that has one (a plait model's ``rng``,
``plait.parallel.random``)."""

from __future__ import annotations

import torch
from torch import nn

from plait.checkpoint.contract import RngState, TrainerState


def rng_state(chunks: list[nn.Module], device: torch.device) -> RngState:
    """The generators' states now (the CUDA one only when ``device`` is a GPU)."""
    cuda = (
        torch.cuda.get_rng_state() if torch.cuda.is_available() and device.type == "cuda" else None
    )
    trackers = {
        i: chunk.rng.get_states()
        for i, chunk in enumerate(chunks)
        if getattr(chunk, "rng", None) is not None
    }
    return RngState(torch.get_rng_state(), cuda, trackers)


def load_rng_state(chunks: list[nn.Module], device: torch.device, state: RngState) -> None:
    """Set the generators to ``state`` (a tracker's only where ``state`` holds that chunk's)."""
    torch.set_rng_state(state.cpu)
    if state.cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state.cuda)
    for i, chunk in enumerate(chunks):
        if getattr(chunk, "rng", None) is not None and i in state.trackers:
            chunk.rng.set_states(state.trackers[i])


def trainer_state(global_samples: int, lr_scheduler, config: dict, data_loader) -> TrainerState:
    """``global_samples``, the schedule's state (or None), ``config`` (the resolved ds_config as a dict), and the
    state of a ``data_loader`` with ``state_dict`` (or None)."""
    return TrainerState(
        global_samples,
        lr_scheduler.state_dict() if lr_scheduler is not None else None,
        config,
        data_loader.state_dict() if hasattr(data_loader, "state_dict") else None,
    )


def load_trainer_state(state: TrainerState, lr_scheduler, data_loader) -> None:
    """Load ``state``'s schedule and ``data_loader`` states into ours (None fields, or none of ours: kept)."""
    if state.lr_scheduler is not None and lr_scheduler is not None:
        lr_scheduler.load_state_dict(state.lr_scheduler)
    if state.data_loader is not None and hasattr(data_loader, "load_state_dict"):
        data_loader.load_state_dict(state.data_loader)
