"""A TRL SFT or DPO script as TRL's docs show users writing them; only the import line names plait (the tests
run a copy with ``from trl import`` for the plain TRL reference, and ``none`` as the config: no DeepSpeed).

    torchrun --nproc-per-node 2 trl_script.py {sft,dpo} OUT DS_CONFIG MAX_STEPS [--resume DIR] [--dropout P]

Writes OUT/losses.jsonl (rank 0: the logged loss, grad_norm and learning_rate of every step) and
OUT/result-RANK.json (the bytes of the reference model's parameters this rank holds, for DPO on plait; the whole
model's bytes). The Trainer's defaults otherwise: max_grad_norm=1.0 (clipping on where the ds_config's
"gradient_clipping" is "auto", as under DeepSpeed).
"""

import argparse
import json

import torch
import torch.distributed as dist
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

from plait.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # was: from trl import ...

cli = argparse.ArgumentParser()
cli.add_argument("task", choices=["sft", "dpo"])
cli.add_argument("out")
cli.add_argument("ds_config")
cli.add_argument("max_steps", type=int)
cli.add_argument("--resume", default=None)
cli.add_argument("--dropout", type=float, default=0.0)
opt = cli.parse_args()

# a word-level tokenizer made here (no hub): 16380 words and 4 special tokens; the vocabulary is large enough
# (16384 x 64 > 1e6 elements) that ZeRO-3 configs with stage3_param_persistence_threshold 1e6 shard the
# embedding and the head
WORDS = [f"w{i}" for i in range(16380)]
vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
)


def words(i, n, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + i)
    return " ".join(WORDS[j] for j in torch.randint(0, 200, (n,), generator=g).tolist())


torch.manual_seed(0)
model = LlamaForCausalLM(
    LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=opt.dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
)
whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())


LOGGED = ("loss", "grad_norm", "learning_rate")


class LossFile(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and "loss" in logs:
            with open(f"{opt.out}/losses.jsonl", "a") as f:
                f.write(
                    json.dumps({"step": state.global_step, **{k: logs.get(k) for k in LOGGED}})
                    + "\n"
                )


common = dict(
    output_dir=opt.out,
    deepspeed=None if opt.ds_config == "none" else opt.ds_config,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=1e-3,
    max_steps=opt.max_steps,
    logging_steps=1,
    save_steps=5,
    report_to=[],
    seed=7,
    use_cpu=True,
    bf16=False,
)
if opt.task == "sft":
    dataset = Dataset.from_dict({"text": [words(i, 8) for i in range(64)]})
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(**common),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[LossFile()],
    )
else:
    dataset = Dataset.from_dict(
        {
            "prompt": [words(i, 4) for i in range(64)],
            "chosen": [words(i, 4, 1) for i in range(64)],
            "rejected": [words(i, 4, 2) for i in range(64)],
        }
    )
    torch.manual_seed(0)
    ref_model = LlamaForCausalLM(model.config)
    ref_model.load_state_dict(model.state_dict())
    trainer = DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=DPOConfig(**common),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[LossFile()],
    )
trainer.train(resume_from_checkpoint=opt.resume)

rank = dist.get_rank() if dist.is_initialized() else 0
ref = getattr(trainer, "ref_model", None)
held = ref.optimizer.memory_bytes()["params"] if hasattr(ref, "optimizer") else None
with open(f"{opt.out}/result-{rank}.json", "w") as f:
    json.dump(
        {
            "ref_params_bytes": held,
            "whole_bytes": whole_bytes,
            "global_step": trainer.state.global_step,
        },
        f,
    )
