"""Exact resume of a collator that draws random numbers, under accelerate's read-ahead.

transformers' train loader (accelerate's ``DataLoaderShard``) reads one micro-batch ahead: micro-batch k+1 is
collated before micro-batch k's forward. A collator that draws from the global generators (MLM masking in
``DataCollatorForLanguageModeling``) has then already drawn for the first micro-batch after a checkpoint when
the checkpoint saves the RNG states; a run resumed from those states draws that micro-batch again from the
later state, and transformers' own resume differs from the uninterrupted run from there on.

``ReadAheadCollate`` wraps the collator (with ``dataloader_num_workers`` 0, where collation runs in the
training process) and keeps the states from just before its latest call; the checkpoint stores them beside
transformers' (``save``). A resumed epoch collates its first micro-batch from those, then returns to
transformers' saved states (``resume``): every draw falls where it fell in the uninterrupted run. The states
are stored as JSON (python's ``random``, numpy's, torch's CPU generator, and CUDA's when present): no pickle,
read back with a size bound from inside the checkpoint folder (``plait.untrusted``).
"""

from __future__ import annotations

import json
import os
import random
from typing import Callable

import numpy as np
import torch

from plait.untrusted import inside, read_json

FILE = "rng_before_read_ahead_{rank}.json"


def capture() -> dict:
    """The global generators' states (python, numpy, torch CPU, each CUDA device), as JSON-ready values."""
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "python": [version, list(state), gauss],
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        states["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return states


def restore(states: dict) -> None:
    """Set the global generators to ``states`` (from ``capture``)."""
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in states["cuda"]])


class ReadAheadCollate:
    """``collate`` keeping the generators' states from just before its latest call (``before_last``).

    After ``resume(before, after)``, the next call collates from ``before`` and leaves the generators at
    ``after`` (transformers' states of the checkpoint)."""

    def __init__(self, collate: Callable):
        self.collate = collate
        self.before_last: dict | None = None
        self._resume: tuple[dict, dict] | None = None

    def resume(self, before: dict, after: dict) -> None:
        self._resume = (before, after)

    def __call__(self, rows):
        if self._resume is None:
            self.before_last = capture()
            return self.collate(rows)
        (before, after), self._resume = self._resume, None
        restore(before)
        self.before_last = before
        batch = self.collate(rows)
        restore(after)
        return batch


def save(folder: str, collate: ReadAheadCollate | None, rank: int) -> None:
    """Write ``collate.before_last`` into the checkpoint folder (nothing when there is none)."""
    if collate is not None and collate.before_last is not None:
        with open(os.path.join(folder, FILE.format(rank=rank)), "w", encoding="utf-8") as fh:
            json.dump(collate.before_last, fh)


def load(folder: str, rank: int) -> dict | None:
    """The states ``save`` wrote for ``rank``, or None (a checkpoint without them resumes as transformers)."""
    if not os.path.lexists(os.path.join(folder, FILE.format(rank=rank))):
        return None
    return read_json(
        inside(folder, FILE.format(rank=rank), "RNG states"), "RNG states"
    )  # bounded, no links out
