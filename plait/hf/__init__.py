"""Hugging Face ``Trainer`` on plait: ``from plait.hf import Trainer, TrainingArguments`` in place of
``from transformers import Trainer, TrainingArguments``; ``TrainingArguments(deepspeed=ds_config)`` keeps
working (the config goes to plait's engine). See ``plait.hf.trainer``. Needs transformers (the ``hf``
extra)."""
from plait.hf.args import TrainingArguments
from plait.hf.trainer import Trainer

__all__ = ["Trainer", "TrainingArguments"]
