"""An accelerate training loop written as accelerate's examples write it (``nlp_example.py``; with an
``optimizer`` section in the ds_config, ``DummyOptim``/``DummyScheduler`` as ``by_feature/
deepspeed_with_config_support.py``); only the import line names plait.

    torchrun --nproc-per-node N accelerate_script.py OUT [--ds_config PATH] [--plain] [--epochs E]
        [--save_epoch K] [--resume DIR --start_epoch K]

``--plain``: the same loop on accelerate itself (the reference; no DeepSpeed). ``--warmup_lr_reference``
(with ``--plain``): the reference for a ds_config whose optimizer and schedule the script does not build itself
(accelerate's ``ds_config_zero2.json``: AdamW with weight decay 0 and DeepSpeed's WarmupLR, warmup 1 step, whose
learning rate is 0 for the first two steps, then the peak): the same written for plain accelerate (whose
``AcceleratedScheduler`` steps a schedule once per process at each optimizer step). Without ``--ds_config`` the
plugin comes from ``accelerate launch``'s environment, if any. A tiny BERT classifier (dropout on), 5
optimizer steps of 2 micro-batches per epoch and process. Writes OUT/result.json (main process): every
micro-batch's loss per process, the gradient norms, learning rates, evaluation accuracy/loss per epoch
(``gather_for_metrics``), and a checksum of ``get_state_dict``.
"""

import argparse
import json
import os
import time

import torch
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from accelerate.utils import DataLoaderConfiguration, set_seed

cli = argparse.ArgumentParser()
cli.add_argument("out")
cli.add_argument("--ds_config", default=None)
cli.add_argument("--plain", action="store_true")
cli.add_argument("--epochs", type=int, default=2)
cli.add_argument("--save_epoch", type=int, default=None)
cli.add_argument("--resume", default=None)
cli.add_argument("--start_epoch", type=int, default=0)
cli.add_argument("--gas", type=int, default=2)
cli.add_argument("--warmup_lr_reference", action="store_true")
args = cli.parse_args()

if args.plain:
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
else:  # was: from accelerate import Accelerator, DeepSpeedPlugin; from accelerate.utils import DummyOptim, DummyScheduler
    from plait.accelerate import Accelerator, DeepSpeedPlugin, DummyOptim, DummyScheduler

LR, BATCH, EVAL_BATCH, MICRO_PER_EPOCH = 2e-3, 4, 8, 10


class Pairs(torch.utils.data.Dataset):
    """Sentence pairs of token ids with a label: fixed length, so no padding is needed."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 96, (n, 16), generator=g)
        self.labels = (self.ids[:, 0] > 48).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(16, dtype=torch.long),
            "labels": self.labels[i],
        }


def main():
    plugin = DeepSpeedPlugin(hf_ds_config=args.ds_config) if args.ds_config else None
    # the seedable sampler: the data order from (seed, epoch), so that a resumed run draws the same order
    # (accelerate's checkpoint does not hold the default sampler's generator at several processes)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gas,
        deepspeed_plugin=plugin,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(42)
    train = Pairs(BATCH * MICRO_PER_EPOCH * accelerator.num_processes, seed=1)
    train_dataloader = DataLoader(train, shuffle=True, batch_size=BATCH)
    eval_dataloader = DataLoader(Pairs(13, seed=2), shuffle=False, batch_size=EVAL_BATCH)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
        )
    )
    steps = (
        len(train_dataloader) * args.epochs // args.gas
    )  # before prepare, as nlp_example: all processes' batches
    ds = accelerator.state.deepspeed_plugin
    if (
        ds is not None and "optimizer" in ds.deepspeed_config
    ):  # deepspeed_with_config_support.py's choice
        optimizer = DummyOptim(model.parameters(), lr=LR)
        lr_scheduler = DummyScheduler(optimizer, total_num_steps=steps, warmup_num_steps=0)
    elif args.warmup_lr_reference:
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=LR, weight_decay=0.0)
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda count: 0.0 if count < 2 * accelerator.num_processes else 1.0
        )
    else:
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=LR)
        lr_scheduler = get_linear_schedule_with_warmup(
            optimizer, num_warmup_steps=1, num_training_steps=steps
        )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if args.resume:
        accelerator.load_state(args.resume)

    record = {"losses": [], "grad_norms": [], "lrs": [], "eval": []}
    for epoch in range(args.start_epoch, args.epochs):
        model.train()
        train_dataloader.set_epoch(epoch)
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    record["grad_norms"].append(None if norm is None else float(norm))
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            record["losses"].append(accelerator.gather(loss.detach()[None]).tolist())
            if accelerator.sync_gradients:
                record["lrs"].append(lr_scheduler.get_last_lr()[0])
        record["eval"].append(evaluate(accelerator, model, eval_dataloader))
        if args.save_epoch == epoch:
            accelerator.save_state(os.path.join(args.out, f"epoch_{epoch}"))
    state = accelerator.get_state_dict(model)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record["checksum"] = float(sum(v.float().abs().sum() for v in state.values()))
        record["mixed_precision"] = accelerator.mixed_precision
        record["gradient_accumulation_steps"] = accelerator.gradient_accumulation_steps
        record["ds_config"] = ds.deepspeed_config if ds is not None else None
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(record, f, default=str)
    accelerator.end_training()
    if args.plain:
        # The reference's exit, not the loop: when this frame frees DDP, its reducer drops the last reference
        # to the gloo process group, whose destructor joins gloo's worker threads with the GIL held; a worker
        # still dropping the last barrier's tensors waits for the GIL, and the process hangs (seen twice in
        # loaded test runs: result.json written, rank 1 stuck in ~ProcessGroupGloo -> thread::join, its worker
        # in take_gil). Releasing the GIL for a moment lets the workers finish first, as plait's own exit
        # does for the same cause (plait.parallel.launch.leave_at_exit).
        time.sleep(0.5)


def evaluate(accelerator, model, eval_dataloader):
    model.eval()
    correct, losses, seen = 0, [], 0
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        predictions, references = accelerator.gather_for_metrics(
            (outputs.logits.argmax(dim=-1), batch["labels"])
        )
        correct += int((predictions == references).sum())
        seen += len(references)
        losses.append(accelerator.gather_for_metrics(outputs.loss.detach()[None]).mean().item())
    return {"accuracy": correct / seen, "seen": seen, "loss": sum(losses) / len(losses)}


if __name__ == "__main__":
    os.makedirs(args.out, exist_ok=True)
    main()
