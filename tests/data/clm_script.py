"""Causal-LM training in the shape of transformers' ``examples/pytorch/language-modeling/run_clm.py`` (written
here, not copied): arguments from the command line through ``HfArgumentParser`` into (model, data, training)
dataclasses, a model built from its config (``--config_overrides``, no hub), the texts tokenized and grouped
into blocks of ``--block_size`` tokens, ``Trainer(...).train()``, ``save_model``, ``evaluate``, ``save_state``.

    torchrun --nproc-per-node 2 clm_script.py --framework plait --tokenizer_file tokenizer.json \\
        --deepspeed ds_config.json --output_dir OUT --do_train --do_eval --max_steps 10 \\
        --per_device_train_batch_size 2 --logging_steps 1 --save_steps 5 --seed 7 --use_cpu --report_to none

``--framework`` picks the one line that differs, the import of ``Trainer`` and ``TrainingArguments``:
``plait`` (``plait.hf``), ``transformers`` (plain transformers: without the deepspeed package it cannot take
``--deepspeed``, so that run leaves the flag out and trains with DDP), or ``ds_reference``
(``tests/data/ds_reference.py``: plain transformers taking the ds_config's learning-rate schedule, as
DeepSpeed would run it, for a machine without DeepSpeed). Everything else is left at its default, the
warm-up included. The losses are in ``OUT/trainer_state.json`` (``log_history``), as in any Trainer run.
"""

import argparse
import random
import sys
from dataclasses import dataclass, field
from itertools import chain

from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    default_data_collator,
    set_seed,
)

pick = argparse.ArgumentParser(add_help=False)
pick.add_argument("--framework", choices=["plait", "transformers", "ds_reference"], default="plait")
framework, argv = pick.parse_known_args()
if framework.framework == "plait":
    from plait.hf import Trainer, TrainingArguments
elif framework.framework == "transformers":
    from transformers import Trainer, TrainingArguments
else:
    from ds_reference import Trainer, TrainingArguments


@dataclass
class ModelArguments:
    model_type: str = field(
        default="gpt2", metadata={"help": "the config class to build the model from"}
    )
    config_overrides: str = field(
        default="n_embd=32,n_layer=2,n_head=4,n_positions=64",
        metadata={"help": "config values, as 'key=value,key=value'"},
    )
    tokenizer_file: str = field(
        default=None, metadata={"help": "a tokenizer.json (no hub download)"}
    )


@dataclass
class DataTrainingArguments:
    block_size: int = field(default=16, metadata={"help": "tokens per training sample"})
    validation_split_percentage: int = field(default=10)
    num_texts: int = field(default=240, metadata={"help": "sentences in the in-memory corpus"})


def corpus(n: int) -> list[str]:
    """``n`` short English sentences, the same on every rank and every run."""
    rng = random.Random(0)
    who = [
        "The farmer",
        "A child",
        "The old king",
        "My sister",
        "The river",
        "A traveller",
        "The teacher",
    ]
    did = ["walked to", "looked at", "spoke about", "dreamed of", "carried water to", "sang about"]
    what = [
        "the city by the sea",
        "a field of wheat",
        "the mountain",
        "his brother",
        "the morning light",
        "a house of stone",
        "the quiet garden",
        "the market",
    ]
    return [f"{rng.choice(who)} {rng.choice(did)} {rng.choice(what)}." for _ in range(n)]


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    set_seed(training_args.seed)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=model_args.tokenizer_file, eos_token="<|endoftext|>", pad_token="[PAD]"
    )
    config = CONFIG_MAPPING[model_args.model_type]()
    config.update_from_string(model_args.config_overrides)
    config.vocab_size = len(tokenizer)
    model = AutoModelForCausalLM.from_config(config)

    tokenized = [
        tokenizer(t + tokenizer.eos_token)["input_ids"] for t in corpus(data_args.num_texts)
    ]
    ids = list(chain.from_iterable(tokenized))
    block = data_args.block_size
    blocks = [
        ids[i : i + block] for i in range(0, len(ids) - block + 1, block)
    ]  # the remainder is dropped
    samples = [{"input_ids": b, "attention_mask": [1] * block, "labels": list(b)} for b in blocks]
    n_eval = len(samples) * data_args.validation_split_percentage // 100
    train_dataset, eval_dataset = samples[n_eval:], samples[:n_eval]

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    sys.exit(main())
