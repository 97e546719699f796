"""RNG tracking for dropout under tensor parallelism and activation recomputation.

Two named random streams per model (Shoeybi et al., "Megatron-LM", 2019, Sec. 3): ``"replicated"``,
seeded identically on every tp rank (dropout where activations are replicated over tp), and ``"tp"``,
seeded with ``seed + 2718 + tp_rank`` (dropout where activations are split over tp).

``tracker.fork(name)`` swaps the stream into the device's default generator for the duration of the block,
then stores the advanced state back. ``checkpoint(fn, *args, tracker=...)`` is activation recomputation
that also rewinds the tracker's streams, so recomputed dropout masks equal the original ones bit for bit.
The tracker is an ordinary object owned by the model; there is no global registry. Which dropout uses
which stream: ``docs/tensor-parallel.md``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.utils.checkpoint

TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named random streams for dropout; see the module docstring.

    Args:
        seed: base seed (the same on every rank of a model replica).
        tp_rank: this rank's tensor-parallel coordinate.
        device: the device whose default generator the streams drive.
    """

    def __init__(self, seed: int, tp_rank: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}
        self.add("replicated", seed)
        self.add("tp", seed + TP_SEED_OFFSET + tp_rank)

    def add(self, name: str, seed: int) -> None:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self.states[name] = gen.get_state()

    @contextmanager
    def fork(self, name: str):
        """Run the block with the default generator of ``self.device`` drawing from stream ``name``."""
        if name not in self.states:
            raise KeyError(f"unknown RNG stream {name!r}; known: {sorted(self.states)}")
        outside = _get_state(self.device)
        _set_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, outside)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


def checkpoint(fn, *args, tracker: RNGTracker | None = None):
    """Activation recomputation of ``fn(*args)`` (torch non-reentrant checkpoint) that replays
    dropout exactly: the default generators are restored by torch, the tracker's streams by us.

    Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016.
    """
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    snapshot = tracker.get_states()
    calls = [0]

    def replaying(*inner):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*inner)
        after = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            return fn(*inner)
        finally:
            tracker.set_states(after)

    return torch.utils.checkpoint.checkpoint(replaying, *args, use_reentrant=False)
