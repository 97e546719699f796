"""The Hugging Face Trainer on one GPU: plait (``plait.hf``) against DeepSpeed and FSDP2 under the same
Trainer script, in the same run.

    python benchmarks/bench_hf_trainer.py [--arms plait-z2-offload,ds-z2-offload,plait-z3,fsdp2]
        [--steps 8] [--warmup 3] [--out results.jsonl]

Model: an unmodified ``transformers.LlamaForCausalLM`` of TinyLlama's shape (hidden 2048, 22 layers, 32 heads,
4 kv heads, ffn 5632, vocab 32000: 1.1B parameters), built from its config, sequence 2048, bf16,
AdamW (lr 1e-4, weight decay 0.1), clip 1.0; random tokens. Arms (each in its own process, launched with
torchrun, one process):

* ``plait-z2-offload``: ``from plait.hf import Trainer, TrainingArguments``, ZeRO-2 + offload_optimizer
  (the seed's ``examples/configs/zero2_offload_hf.json``), micro-batch 4;
* ``ds-z2-offload``: ``from transformers import ...`` with ``deepspeed=`` the same config (DeepSpeed
  0.19.8, DeepSpeedCPUAdam), micro-batch 4;
* ``plait-z3``: plait.hf, ZeRO-3 without offload, micro-batch 4;
* ``fsdp2``: transformers' Trainer with ``fsdp="full_shard auto_wrap"``, FSDP2 (``fsdp_config: version 2``)
  wrapping each ``LlamaDecoderLayer``, micro-batch 4.

Reported per arm: tokens/s over the timed steps (wall time between the ends of the warm-up and the last
step, each end after a CUDA synchronization), peak GPU memory (``torch.cuda.max_memory_allocated``), the
last logged loss. Each arm prints one ``RESULT {json}`` line; the parent prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SMOKE = os.environ.get("BENCH_SMOKE") == "1"   # a tiny model on the CPU: checks the script, measures nothing
SEQ, MICRO = (64, 2) if SMOKE else (2048, 4)
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=SEQ)
if SMOKE:
    SHAPE.update(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ds_config(arm: str) -> dict:
    if arm.endswith("z2-offload"):
        with open(os.path.join(ROOT, "examples", "configs", "zero2_offload_hf.json")) as f:
            return json.load(f)
    return {"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                                  "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto"}}


def run_arm(arm: str, steps: int, warmup: int) -> dict:
    import torch
    import transformers
    if arm.startswith("plait"):
        from plait.hf import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    n_params = sum(p.numel() for p in model.parameters())

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return MICRO * (steps + warmup) * 4

        def __getitem__(self, i):
            ids = torch.randint(0, SHAPE["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    marks = {}

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (warmup, warmup + steps):
                if not SMOKE:
                    torch.cuda.synchronize()
                marks[state.global_step] = time.perf_counter()
            if state.global_step == warmup and not SMOKE:
                torch.cuda.reset_peak_memory_stats()

    extra = {}
    if arm.startswith(("plait", "ds")):
        extra["deepspeed"] = ds_config(arm)
    if arm == "fsdp2":
        extra.update(fsdp="full_shard auto_wrap",
                     fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                  "reshard_after_forward": True})
    out_dir = tempfile.mkdtemp(prefix=f"bench_{arm}_")
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=1,
                             learning_rate=1e-4, weight_decay=0.1, max_grad_norm=1.0,
                             max_steps=warmup + steps, logging_steps=1, save_strategy="no", report_to=[],
                             lr_scheduler_type="constant", warmup_steps=1, dataloader_num_workers=2,
                             use_cpu=SMOKE, bf16=not SMOKE, **extra)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    dt = marks[warmup + steps] - marks[warmup]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"arm": arm, "params": n_params, "tokens_per_s": MICRO * SEQ * steps / dt, "step_s": dt / steps,
            "peak_gib": 0.0 if SMOKE else torch.cuda.max_memory_allocated() / 2**30,
            "loss": losses[-1] if losses else None, "train_s": total,
            "device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": transformers.__version__}


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("--arms", default="plait-z2-offload,ds-z2-offload,plait-z3,fsdp2")
    cli.add_argument("--steps", type=int, default=8)
    cli.add_argument("--warmup", type=int, default=3)
    cli.add_argument("--out", default=None)
    cli.add_argument("--arm", default=None, help=argparse.SUPPRESS)   # the child process
    opt = cli.parse_args()
    if opt.arm:
        print("RESULT " + json.dumps(run_arm(opt.arm, opt.steps, opt.warmup)), flush=True)
        return
    rows = []
    for arm in opt.arms.split(","):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", __file__,
               "--arm", arm, "--steps", str(opt.steps), "--warmup", str(opt.warmup)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        row = json.loads(found[-1][7:]) if found else {"arm": arm, "error": (done.stderr or done.stdout)[-1500:]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if opt.out:
            with open(opt.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print("\n| arm | tokens/s | step s | peak GPU GiB | last loss |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['arm']} | failed | | | |")
        else:
            print(f"| {r['arm']} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {r['peak_gib']:.2f} | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
