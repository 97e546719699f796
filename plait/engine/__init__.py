"""The training engine: ``initialize()`` builds an ``Engine`` (DeepSpeed's training API over plait's ZeRO,
tensor, pipeline, context and expert parallelism).

Modules: ``build`` (``initialize``), ``core`` (``Engine``), ``optimizer`` (ZeRO and the schedule it
steps), ``guard`` and ``batch`` (micro-batch checks agreed over the ranks, the non-finite guard, timeouts),
``ranks`` (start-up agreement), ``report`` and ``monitor`` (logs and monitors), ``model`` (placing and
wrapping the model), ``offload``, ``pipeline``, ``moe``, ``context`` and ``compile`` (the satellites of
each feature), ``gc_schedule`` (the garbage-collection schedule).
"""

from plait.engine.build import initialize
from plait.engine.core import Engine

__all__ = ["Engine", "initialize"]
