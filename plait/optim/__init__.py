"""Optimizers and learning-rate schedules the engine builds from a ds_config.

* ``plait.optim.lamb``: ``Lamb`` (per-tensor trust ratio), and ``plait.optim.lamb_segments`` tells it
  which elements of ZeRO's flat shards belong to which tensor;
* ``plait.optim.schedulers``: DeepSpeed's ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``;
* ``plait.optim.factory``: ``optimizer.type`` / ``scheduler.type`` (or a user's optimizer) to what
  ``ZeroOptimizer`` builds over the fp32 master shards.
"""

from plait.optim.lamb import Lamb
from plait.optim.schedulers import SCHEDULERS, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["Lamb", "SCHEDULERS", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
