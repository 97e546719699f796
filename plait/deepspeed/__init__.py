"""DeepSpeed's entry points on plait: a script written for DeepSpeed's engine runs after changing only
its import line::

    import plait.deepspeed as deepspeed          # was: import deepspeed

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset,
        config="ds_config.json")
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt", client_state={"epoch": 1})

Names, keyword arguments, return values and counters are DeepSpeed's (``deepspeed.initialize``,
``deepspeed.init_distributed``, ``deepspeed.add_config_arguments``, ``deepspeed.zero.GatheredParameters``,
``deepspeed.comm``). Where plait cannot do what DeepSpeed would, it raises, naming the argument and the
alternative; it never ignores an argument that changes training. plait's own API is ``plait.initialize``.
"""
from __future__ import annotations

from plait.deepspeed import comm, zero
from plait.deepspeed.entry import add_config_arguments, init_distributed, initialize

__all__ = ["add_config_arguments", "comm", "init_distributed", "initialize", "zero"]
