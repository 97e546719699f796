"""``garbage_collection.interval`` (``plait.engine.gc_schedule``): Python's automatic cyclic collector off, one full
collection after every N-th optimizer step. Counted with ``gc.callbacks`` (full = generation 2) and checked
by what it is for: a reference cycle made in a step lives until the scheduled collection frees it. Every test
restores the collector's state (it is process-wide)."""

import gc
import weakref

import pytest
import torch

import plait
from plait.config import ConfigError
from plait.layers import TransformerModel
from helpers import tiny

MICRO = 2


@pytest.fixture(autouse=True)
def restore_collector():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def engine_with(**extra):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }
    return plait.initialize(TransformerModel(tiny(vocab_size=97), None, seed=3), cfg)


class Cycle:
    def __init__(self):
        self.me = self


def steps_with_a_cycle(engine, steps, poisoned=()):
    """Per step: make a reference cycle, train one step (its loss times inf for the steps in ``poisoned``:
    the nonfinite guard skips them); return, per step, the full collections that ran during it and whether
    that step's cycle is still alive after it."""
    full, log = [], []
    note = lambda phase, info: (
        full.append(1) if phase == "start" and info["generation"] == 2 else None
    )  # noqa: E731
    gc.callbacks.append(note)
    try:
        for step in range(steps):
            alive, before = weakref.ref(Cycle()), len(full)
            ids = torch.randint(0, 97, (MICRO, 9), generator=torch.Generator().manual_seed(step))
            loss = engine(input_ids=ids[:, :-1], labels=ids[:, 1:])
            engine.backward(loss * float("inf") if step in poisoned else loss)
            engine.step()
            log.append((len(full) - before, alive() is not None))
    finally:
        gc.callbacks.remove(note)
    return log


def test_a_full_collection_runs_after_every_nth_step_only():
    gc.enable()
    engine = engine_with(garbage_collection={"interval": 2})
    assert not gc.isenabled()
    assert steps_with_a_cycle(engine, 5) == [
        (0, True),
        (1, False),
        (0, True),
        (1, False),
        (0, True),
    ]


def test_skipped_steps_count_once_as_every_rank_counts_them():
    """Step 0 skipped (a non-finite gradient): the collections still follow ``engine.global_steps`` (applied
    and skipped steps), after steps 2 and 4; counting the skip twice would move them to steps 1 and 3."""
    engine = engine_with(garbage_collection={"interval": 2})
    log = steps_with_a_cycle(engine, 4, poisoned={0})
    assert (engine.global_steps, engine.skipped_steps) == (4, 1)
    assert log == [(0, True), (1, False), (0, True), (1, False)]


def test_interval_zero_leaves_the_collector_alone():
    gc.enable()
    engine_with()
    assert gc.isenabled()
    gc.disable()
    engine_with(garbage_collection={"interval": 0})
    assert not gc.isenabled()


def test_a_negative_interval_is_refused_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"garbage_collection.interval must be >= 0 optimizer steps.*-1"
    ):
        engine_with(garbage_collection={"interval": -1})
