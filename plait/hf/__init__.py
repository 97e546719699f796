"""Hugging Face ``Trainer`` on plait: ``from plait.hf import Trainer, TrainingArguments`` in place of
``from transformers import Trainer, TrainingArguments``; ``TrainingArguments(deepspeed=ds_config)`` keeps
working (the config goes to plait's engine). See ``plait.hf.trainer``; ``plait.hf.from_pretrained`` builds a
model whose weights each rank then reads in part (``plait.hf.loading``). Needs transformers (the ``hf``
extra). ``plait.hf.with_plait_engine(TrainerSubclass)`` (with ``with_plait_arguments(ArgsSubclass)``) gives any
``transformers.Trainer`` subclass plait's engine (``plait.hf.subclass``; ``plait.trl`` is made with it)."""

from plait.hf.args import TrainingArguments
from plait.hf.loading import from_pretrained
from plait.hf.subclass import with_plait_arguments, with_plait_engine
from plait.hf.trainer import Trainer

__all__ = [
    "Trainer",
    "TrainingArguments",
    "from_pretrained",
    "with_plait_arguments",
    "with_plait_engine",
]
