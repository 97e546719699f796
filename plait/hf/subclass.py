"""Any ``transformers.Trainer`` subclass on plait's engine: ``with_plait_engine(MyTrainer)``.

A library's trainer (TRL's ``SFTTrainer``, a user's own subclass) overrides some of the Trainer's methods
(``compute_loss``, ``training_step``, ``log``, ``_save_checkpoint``...) and calls ``super()`` for the rest.
``with_plait_engine`` puts plait's Trainer (``plait.hf.Trainer``) between that class and transformers'::

    PlaitSFT = with_plait_engine(trl.SFTTrainer)
    # method order: PlaitSFT -> trl.SFTTrainer -> (its bases) -> plait.hf.Trainer -> transformers.Trainer

so every override of the subclass still runs, and where it calls ``super()`` it reaches plait's loop,
engine, checkpoints and ``save_model`` instead of transformers' accelerate/DeepSpeed ones.
``with_plait_arguments`` does the same for the arguments class (``deepspeed=`` goes to plait's engine).
"""

from __future__ import annotations

import dataclasses

import transformers

from plait.hf.args import TrainingArguments
from plait.hf.trainer import Trainer


def with_plait_engine(
    trainer_class: type, engine_trainer: type = Trainer, module: str | None = None
) -> type:
    """A subclass of ``trainer_class`` (a ``transformers.Trainer`` subclass) whose loop, engine and checkpoints
    are ``engine_trainer``'s (``plait.hf.Trainer`` or a subclass of it), placed just above transformers' Trainer
    in the method order (module docstring). Its arguments must then be plait's (``with_plait_arguments``).
    ``module``: the module the new class is reachable from by its name (default: ``engine_trainer``'s).

    Raises:
        TypeError: ``trainer_class`` is not a ``transformers.Trainer`` subclass, or ``engine_trainer`` is not
            ``plait.hf.Trainer`` or a subclass of it.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(
            f"with_plait_engine needs a transformers.Trainer subclass, got {trainer_class!r}"
        )
    if not issubclass(engine_trainer, Trainer):
        raise TypeError(
            f"with_plait_engine: engine_trainer must be plait.hf.Trainer or a subclass, got {engine_trainer!r}"
        )
    if issubclass(trainer_class, engine_trainer):
        return trainer_class
    doc = (
        f"``{trainer_class.__module__}.{trainer_class.__qualname__}`` on plait's engine "
        f"(``plait.hf.with_plait_engine``): same arguments, with ``args`` from ``with_plait_arguments``."
    )
    return type(
        trainer_class.__name__,
        (trainer_class, engine_trainer),
        {
            "__doc__": doc,
            "__module__": module or engine_trainer.__module__,
            "__qualname__": trainer_class.__qualname__,
        },
    )


def with_plait_arguments(arguments_class: type, module: str | None = None) -> type:
    """A dataclass subclass of ``arguments_class`` (a ``transformers.TrainingArguments`` subclass, e.g. TRL's
    ``SFTConfig``) that is also ``plait.hf.TrainingArguments``: ``deepspeed=`` (or ``plait=``) is the ds_config for
    plait's engine, every other field is ``arguments_class``'s with its defaults. ``module``: as for
    ``with_plait_engine`` (default ``plait.hf.args``).

    Raises:
        TypeError: ``arguments_class`` is not a ``transformers.TrainingArguments`` subclass.
    """
    if not (
        isinstance(arguments_class, type)
        and issubclass(arguments_class, transformers.TrainingArguments)
    ):
        raise TypeError(
            f"with_plait_arguments needs a transformers.TrainingArguments subclass, got {arguments_class!r}"
        )
    if issubclass(arguments_class, TrainingArguments):
        return arguments_class
    doc = (
        f"``{arguments_class.__module__}.{arguments_class.__qualname__}`` whose ``deepspeed=`` (or ``plait=``) "
        "ds_config goes to plait's engine (``plait.hf.with_plait_arguments``)."
    )
    made = type(
        arguments_class.__name__,
        (arguments_class, TrainingArguments),
        {
            "__doc__": doc,
            "__module__": module or TrainingArguments.__module__,
            "__qualname__": arguments_class.__qualname__,
        },
    )
    return dataclasses.dataclass(made)
