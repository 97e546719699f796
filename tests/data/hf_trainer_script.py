"""A Hugging Face Trainer script as users write them for DeepSpeed; only the import line names plait.

    torchrun --nproc-per-node 2 hf_trainer_script.py OUT DS_CONFIG {llama,bert} MAX_STEPS [--resume DIR]
        [--gas N] [--bf16]

Writes OUT/losses.jsonl (the logged loss of every step, rank 0) and OUT/result.json (rank 0: the largest
difference between the trained model's logits and those of ``from_pretrained(OUT/final)``, and the
evaluation losses).
"""

import argparse
import json

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, TrainerCallback

from plait.hf import (
    Trainer,
    TrainingArguments,
)  # was: from transformers import Trainer, TrainingArguments

cli = argparse.ArgumentParser()
cli.add_argument("out")
cli.add_argument("ds_config")
cli.add_argument("model", choices=["llama", "bert"])
cli.add_argument("max_steps", type=int)
cli.add_argument("--resume", default=None)
cli.add_argument("--gas", type=int, default=2)
cli.add_argument("--bf16", action="store_true")
opt = cli.parse_args()

torch.manual_seed(0)
if opt.model == "llama":
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
else:
    model = BertForMaskedLM(
        BertConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class LossFile(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and "loss" in logs:
            with open(f"{opt.out}/losses.jsonl", "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


args = TrainingArguments(
    output_dir=opt.out,
    deepspeed=opt.ds_config,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=opt.gas,
    learning_rate=1e-3,
    max_steps=opt.max_steps,
    logging_steps=1,
    save_steps=3,
    eval_strategy="steps",
    eval_steps=3,
    report_to=[],
    seed=7,
    use_cpu=True,
    bf16=opt.bf16,
)  # warm-up left at its default (0 steps)
trainer = Trainer(
    model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(), callbacks=[LossFile()]
)
trainer.train(resume_from_checkpoint=opt.resume)
trainer.save_model(f"{opt.out}/final")

ids = Tokens()[0]["input_ids"][None]
with trainer.engine.gathered_parameters(), torch.no_grad():
    trained = trainer.engine.module(input_ids=ids).logits.float()
if dist.get_rank() == 0:
    reloaded = type(trainer.engine.module).from_pretrained(
        f"{opt.out}/final", dtype=trainer.engine.module.dtype
    )
    with torch.no_grad():
        again = reloaded(input_ids=ids).logits.float()
    with open(f"{opt.out}/result.json", "w") as f:
        json.dump(
            {
                "max_logit_diff": (trained - again).abs().max().item(),
                "eval_losses": [
                    h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h
                ],
                "global_step": trainer.state.global_step,
            },
            f,
        )
