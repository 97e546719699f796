"""Hugging Face ``Trainer`` on plait: ``from plait.hf import Trainer, TrainingArguments`` in place of
``from transformers import Trainer, TrainingArguments``; ``TrainingArguments(deepspeed=ds_config)`` keeps
working (the config goes to plait's engine). See ``plait.hf.trainer``; ``plait.hf.from_pretrained`` builds a
model whose weights each rank then reads in part (``plait.hf.loading``). Needs transformers (the ``hf``
extra)."""
from plait.hf.args import TrainingArguments
from plait.hf.loading import from_pretrained
from plait.hf.trainer import Trainer

__all__ = ["Trainer", "TrainingArguments", "from_pretrained"]
