"""Tensor-parallel training demo on CPU: a small GPT-2 split over every process with tensor and
sequence parallelism, trained on the bundled World English Bible with the bundled BPE tokenizer.

    torchrun --nproc-per-node 2 examples/tp_demo.py [--steps 200]

Prints the training loss every 20 steps and the validation loss before and after; every tp
rank holds 1/tp of each attention and MLP weight and computes the same loss.
"""

import argparse
import time

import torch
import torch.distributed as dist

from plait.data import DistributedBatches, TokenDataset, bundled_token_file
from plait.layers import TransformerModel
from plait.models import gpt2_config
from plait.parallel import ParallelMesh, init_distributed


@torch.no_grad()
def validation_loss(model, val, batches: int = 8) -> float:
    model.eval()
    loader = iter(DistributedBatches(val, micro_batch_size=8, dp_rank=0, dp_size=1, seed=0))
    total = sum(model(**next(loader)).item() for _ in range(batches)) / batches
    model.train()
    return total


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    info = init_distributed()
    mesh = ParallelMesh(tp=info.world_size)  # every process is one tp shard
    if info.rank == 0:
        bundled_token_file()  # tokenize once (about 2 s), then cached
    dist.barrier()
    tokens = bundled_token_file()
    train = TokenDataset(tokens, seq_len=args.seq, split="train", val_fraction=0.02)
    val = TokenDataset(tokens, seq_len=args.seq, split="val", val_fraction=0.02)

    config = gpt2_config(
        vocab_size=8192,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        max_position_embeddings=args.seq,
    )
    model = TransformerModel(config, mesh, sequence_parallel=mesh.tp > 1, seed=1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1
    )
    local = sum(p.numel() for p in model.parameters())
    say = print if info.rank == 0 else (lambda *a, **k: None)
    say(
        f"plait tp demo: {mesh}, {config.num_parameters() / 1e6:.2f}M parameters, {local / 1e6:.2f}M on this rank"
    )
    start_val = validation_loss(model, val)
    say(f"step     0  val loss {start_val:.3f}")

    loader = iter(
        DistributedBatches(train, micro_batch_size=args.micro_batch, dp_rank=0, dp_size=1, seed=1)
    )
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = model(**next(loader))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 20 == 0 or step == args.steps:
            tokens_s = step * args.micro_batch * args.seq / (time.perf_counter() - t0)
            say(
                f"step {step:5d}  loss {loss.item():.3f}  lr {schedule.get_last_lr()[0]:.2e}  {tokens_s:,.0f} tokens/s"
            )
    end_val = validation_loss(model, val)
    say(f"validation loss {start_val:.3f} -> {end_val:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
