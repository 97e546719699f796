"""DeepSpeed's entry points on plait: a script written for DeepSpeed's engine runs after changing only
its import line::

    import plait.deepspeed as deepspeed          # was: import deepspeed

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset,
        config="ds_config.json")

Names, keyword arguments, return values and counters are DeepSpeed's (``initialize``, ``init_distributed``,
``add_config_arguments``, ``zero.GatheredParameters``, ``comm``). Where plait cannot do what DeepSpeed would,
it raises, naming the argument and the alternative; it never ignores an argument that changes training.
plait's own API is ``plait.initialize``; see ``docs/migrating.md``.
"""

from __future__ import annotations

from plait.deepspeed import comm, zero
from plait.deepspeed.entry import add_config_arguments, init_distributed, initialize

__all__ = ["add_config_arguments", "comm", "init_distributed", "initialize", "zero"]
