"""TRL's ``SFTTrainer`` on one GPU: plait (``plait.trl``) against DeepSpeed under the same TRL script, in the
same run (issue 42's GPU measurement).

    python benchmarks/bench_trl.py [--arms plait-z2,ds-z2,plait-z3,ds-z3] [--steps 8] [--warmup 3]
        [--out rows.jsonl] [--log arms.log]
    BENCH_SMOKE=1 python benchmarks/bench_trl.py --arms plait-z2,plait-z3   # tiny model on the CPU: checks the script
    BENCH_SMOKE=1 python benchmarks/bench_trl.py --show-args               # each arm's SFTConfig arguments

Model: bench_hf_trainer's unmodified ``transformers.LlamaForCausalLM`` of TinyLlama's shape (1.1B parameters,
vocabulary 32000), built from its config; bf16, micro-batch 4, TRL's ``SFTConfig`` defaults otherwise
(``gradient_checkpointing=True``, its loss, its metrics), with the shared ``TrainingArguments`` of _trainer.py
(AdamW lr 1e-4, weight decay 0.1, clip 1.0, a loss logged every step).
Data: no network. The bundled corpus (``plait.data.bundled``: the World English Bible) as a text dataset of
documents of 64 lines, tokenized by TRL with the bundled 8192-entry BPE tokenizer and packed by TRL
(``packing=True, packing_strategy="wrapped"``, ``max_length=2048``); the one shorter remainder row is dropped,
so every micro-batch is 4 x 2048 tokens with no padding.
Arms (each in its own process, torchrun, one process; ``_trainer.launch_arm``):

* ``plait-z2``: ``from plait.trl import SFTConfig, SFTTrainer`` with ``deepspeed=`` open-instruct's ZeRO-2
  config (``tests/data/ds_configs/open-instruct__stage2_no_offloading_accelerate.json``, as published: bf16
  "auto", no optimizer section, so the Trainer's own AdamW);
* ``ds-z2``: ``from trl import SFTConfig, SFTTrainer``, the same config, DeepSpeed;
* ``plait-z3`` / ``ds-z3``: the same config with ``zero_optimization.stage`` 3.

Reported per arm: tokens/s over the timed steps, peak GPU memory, host peak, the last logged loss
(``_trainer.timed_train``); the parent prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _trainer import (
    MICRO,
    ROOT,
    SEQ,
    SHAPE,
    launch_arm,
    print_table,
    step_clock,  # noqa: E402
    timed_train,
    trainer_arguments,
)

ARMS = ("plait-z2", "ds-z2", "plait-z3", "ds-z3")
CONFIG = os.path.join(
    ROOT, "tests", "data", "ds_configs", "open-instruct__stage2_no_offloading_accelerate.json"
)
LINES_PER_DOCUMENT = 64


def arm_ds_config(arm: str) -> dict:
    """open-instruct's ZeRO-2 config as published; the ``-z3`` arms change only its stage to 3."""
    with open(CONFIG) as f:
        config = json.load(f)
    if arm.endswith("-z3"):
        config["zero_optimization"]["stage"] = 3
    return config


def sft_arguments(arm: str, steps: int, warmup: int) -> dict:
    """The ``SFTConfig`` keyword arguments of ``arm``: the same for plait and DeepSpeed at one stage."""
    if arm not in ARMS:
        raise SystemExit(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    return {
        **trainer_arguments(arm, MICRO, warmup + steps),
        "deepspeed": arm_ds_config(arm),
        "max_length": SEQ,
        "packing": True,
        "packing_strategy": "wrapped",
        "dataset_text_field": "text",
    }


def bundled_tokenizer():
    """The bundled 8192-entry byte-level BPE as a transformers tokenizer (pad ``[PAD]``, eos ``<|endoftext|>``)."""
    from transformers import PreTrainedTokenizerFast

    from plait.data.bundled import bundled_tokenizer_path

    return PreTrainedTokenizerFast(
        tokenizer_file=str(bundled_tokenizer_path()),
        pad_token="[PAD]",
        eos_token="<|endoftext|>",
        unk_token="[UNK]",
    )


def corpus_dataset(tokens: int):
    """A ``datasets.Dataset`` of ``{"text": ...}`` documents of ``LINES_PER_DOCUMENT`` lines from the start of
    the bundled corpus, until they hold ``8 * tokens`` characters: about twice ``tokens`` tokens (the bundled
    BPE reads about 4.2 characters a token)."""
    from datasets import Dataset

    from plait.data.bundled import load_bundled_text

    lines = load_bundled_text().splitlines()
    docs, size = [], 0
    for i in range(0, len(lines), LINES_PER_DOCUMENT):
        docs.append("\n".join(lines[i : i + LINES_PER_DOCUMENT]))
        size += len(docs[-1])
        if size > 8 * tokens:
            break
    return Dataset.from_dict({"text": docs})


def run_arm(arm: str, steps: int, warmup: int) -> dict:
    import torch
    import transformers

    if arm.startswith("plait"):
        from plait.trl import SFTConfig, SFTTrainer
    else:
        from trl import SFTConfig, SFTTrainer
    import trl

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    tokenizer = bundled_tokenizer()
    args = SFTConfig(**sft_arguments(arm, steps, warmup))
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **{**SHAPE, "vocab_size": max(SHAPE["vocab_size"], len(tokenizer))}
        )
    )
    n_params = sum(p.numel() for p in model.parameters())
    clock = step_clock(warmup, steps)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=corpus_dataset(MICRO * SEQ * (warmup + steps)),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    packed = trainer.train_dataset.filter(
        lambda row: len(row["input_ids"]) == SEQ
    )  # the remainder row out
    if len(packed) < MICRO * (warmup + steps):
        raise RuntimeError(
            f"{len(packed)} packed rows of {SEQ} tokens, {MICRO * (warmup + steps)} needed"
        )
    trainer.train_dataset = packed
    row = timed_train(arm, trainer, clock, MICRO * SEQ, n_params)
    row.update(
        micro=MICRO,
        seq=SEQ,
        zero_stage=arm_ds_config(arm)["zero_optimization"]["stage"],
        ds_config=os.path.basename(CONFIG),
        trl=trl.__version__,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    if arm.startswith("ds"):
        import deepspeed

        row["deepspeed"] = deepspeed.__version__
    return row


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("--arms", default=",".join(ARMS))
    cli.add_argument("--steps", type=int, default=8)
    cli.add_argument("--warmup", type=int, default=3)
    cli.add_argument("--out", default=None, help="append each arm's row (JSON) to this file")
    cli.add_argument("--log", default=None, help="append each arm's full output to this file")
    cli.add_argument(
        "--show-args", action="store_true", help="print each arm's SFTConfig arguments and stop"
    )
    cli.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # the child process
    opt = cli.parse_args()
    if opt.arm:
        print("RESULT " + json.dumps(run_arm(opt.arm, opt.steps, opt.warmup)), flush=True)
        return
    arms = opt.arms.split(",")
    if opt.show_args:
        for arm in arms:
            kwargs = sft_arguments(arm, opt.steps, opt.warmup)
            kwargs.pop("output_dir")
            print(arm, json.dumps(kwargs, sort_keys=True))
        return
    print_table(
        [
            launch_arm(
                __file__,
                arm,
                ["--steps", str(opt.steps), "--warmup", str(opt.warmup)],
                1,
                opt.log,
                opt.out,
            )
            for arm in arms
        ]
    )


if __name__ == "__main__":
    main()
