"""Cost of the engine's micro-batch checks (``plait.engine.batch``: token ids and labels in ``[0, vocab)``) on one GPU.

    python benchmarks/bench_input_checks.py [--rounds 96] [--out results.jsonl]

llama-886m (ANCHORS.md), plait ZeRO-2, bf16, AdamW, clip 1.0, sequence 2048, micro-batch 4, one process.
Arms, taking turns step by step in one process on one engine (so machine drift hits every arm alike):

* ``device``: ``engine(**batch)``, ``backward``, ``step`` with the batch already on the GPU (the check
  costs one min/max per tensor and one host synchronization);
* ``host``: ``engine.train_batch`` on batches still on the host (checked there, then moved);

each with the check (``check``) and with it replaced by a no-op (``no check``). Reported: the median step
time and the ratio of each ``check`` arm's speed to its ``no check`` arm's; and the check alone (median
microseconds per micro-batch, device and host tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SEQ, MICRO = 2048, 4


def make_engine():
    import plait
    from plait.layers import TransformerModel
    from plait.models import preset
    from plait.parallel import ParallelMesh

    cfg = preset("llama-886m")
    model = TransformerModel(cfg, None, seed=0, device="cuda")
    conf = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        },
    }
    return cfg, plait.initialize(model, conf, mesh=ParallelMesh())


def batch(cfg, step, device):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.vocab_size, (MICRO, SEQ + 1), generator=g)
    return {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)}


def time_arm(arm, engine, cfg, steps, start):
    import plait.engine.guard as guard_mod
    from plait.engine.batch import screen_micro_batch

    calls = []

    def counted(b, v):  # proves the arm's screen is the one the engine calls
        calls.append(1)
        return (dict(b), None) if arm.endswith("no check") else screen_micro_batch(b, v)

    guard_mod.screen_micro_batch = counted
    host = arm.startswith("host")
    device = "cpu" if host else "cuda"
    batches = [batch(cfg, start + i, device) for i in range(steps)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches:
        if host:
            engine.train_batch(iter([b]))
        else:
            engine.backward(engine(**b))
            engine.step()
    torch.cuda.synchronize()
    rate = steps * MICRO * SEQ / (time.perf_counter() - t0)
    assert len(calls) == steps, f"{arm}: the engine screened {len(calls)} of {steps} micro-batches"
    return rate


def check_alone(cfg, reps=200):
    from plait.engine.batch import BatchLimits, check_micro_batch

    out, limits = {}, BatchLimits(cfg.vocab_size, cfg.max_position_embeddings)
    for device in ("cuda", "cpu"):
        b = batch(cfg, 0, device)
        for _ in range(10):
            check_micro_batch(b, limits)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            check_micro_batch(b, limits)
            times.append(time.perf_counter() - t0)
        out[device] = statistics.median(times) * 1e6
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--rounds", type=int, default=96, help="steps per arm; the arms take turns step by step"
    )
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "input_checks.jsonl"))
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl")
    cfg, engine = make_engine()
    arms = ("device, no check", "device, check", "host, no check", "host, check")
    for arm in arms:  # warm-up: allocator, cuBLAS handles, every path
        time_arm(arm, engine, cfg, 3, 0)
    # one step per arm in turn (order rotated each round), so drift of the machine hits every arm alike;
    # each step is timed to its end (a sync after it), the median step time per arm is compared
    seconds = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for k in range(len(arms)):
            arm = arms[(r + k) % len(arms)]
            seconds[arm].append(MICRO * SEQ / time_arm(arm, engine, cfg, 1, 100 + r))
    alone = check_alone(cfg)
    print(
        f"device: {torch.cuda.get_device_name(0)}; llama-886m ZeRO-2 bf16, seq {SEQ}, micro-batch {MICRO}, "
        f"{args.rounds} steps per arm, the arms taking turns step by step"
    )
    print(
        "| arm | median step ms | tokens/s | vs the same path without the check | p10-p90 step ms |"
    )
    print("|---|---|---|---|---|")
    with open(args.out, "w") as f:
        for arm in arms:
            med = statistics.median(seconds[arm])
            base = statistics.median(seconds[arm.split(",")[0] + ", no check"])
            dec = statistics.quantiles(seconds[arm], n=10)
            print(
                f"| {arm} | {med * 1e3:.2f} | {MICRO * SEQ / med:,.0f} | {base / med:.4f} | "
                f"{dec[0] * 1e3:.1f}-{dec[-1] * 1e3:.1f} |"
            )
            f.write(json.dumps({"arm": arm, "step_seconds": seconds[arm], "median": med}) + "\n")
        f.write(json.dumps({"check_alone_us": alone}) + "\n")
    print(
        f"check alone, per micro-batch: {alone['cuda']:.0f} us on GPU tensors, {alone['cpu']:.0f} us on host tensors"
    )


if __name__ == "__main__":
    main()
