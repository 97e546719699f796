"""Python's cyclic garbage collector on the optimizer-step schedule, the same step on every rank.

Python's automatic collector starts a full (generation 2) collection whenever enough objects have survived
younger collections; one takes 0.1-0.2 s in a process that holds torch and a model, inside whatever step
happens to be running. Under data parallelism one rank's pause stalls every rank at the next collective,
and the ranks pause at different steps. ``garbage_collection.interval = N`` (N > 0) turns the automatic
collector off for the rest of the process (``gc.disable()``, after one full ``gc.collect()``) and runs a
full collection after every N-th optimizer step, skipped steps included, so the pauses line up and stay
out of forward and backward (Megatron-LM's ``--manual-gc``/``--manual-gc-interval``; torchtitan's
``training.gc_freq``, which collects generation 1). Reference counting still frees every object that is in no
cycle; a cycle made between two collections is freed at the next one. The setting is process-wide and outlives
the engine. ``N = 0`` (the default) leaves the collector as it is. Independently, a pipeline's step pauses
the automatic collector for its own duration (``plait.parallel.pipeline.executor``).
"""

from __future__ import annotations

import gc


class CollectionSchedule:
    """Full collections after every ``interval``-th optimizer step (0: Python's automatic collection;
    ``GarbageCollectionConfig`` refuses a negative one)."""

    def __init__(self, interval: int):
        self.interval = interval
        if interval > 0:
            gc.collect()
            gc.disable()

    def after_step(self, steps: int) -> None:
        """``steps``: optimizer steps so far (applied and skipped: every rank counts the same)."""
        if self.interval > 0 and steps % self.interval == 0:
            gc.collect()
