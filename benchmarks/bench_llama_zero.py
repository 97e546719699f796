"""Training throughput of llama-886m (ANCHORS.md) on one GPU: plait ZeRO-2/3 beside plain torch,
FSDP2 and DeepSpeed ZeRO-2/3, all on the same model code, in the same run.

    python benchmarks/bench_llama_zero.py [--arms plain,fsdp2,plait-z2,plait-z3,ds-z2,ds-z3] [--steps 10]

Each arm runs in its own process (fresh CUDA memory statistics): sequence 2048, micro-batch 4, bf16,
AdamW (lr 1e-4, wd 0.1, betas 0.9/0.95), gradient clipping 1.0, no activation checkpointing. The
model is plait's ``TransformerModel`` (tp=1) for every arm, so the arms differ only in the training
wrapper. Reported: tokens/s, MFU = tokens/s x (6N + 6 x layers x hidden x seq) / 989e12 (bf16 dense
peak of H100/H200 SXM, as ANCHORS.md), peak GiB (torch.cuda.max_memory_allocated), mean of the timed
steps after --warmup steps. Prints a markdown table and writes JSON lines to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ARMS = ("plain", "fsdp2", "plait-z2", "plait-z3", "ds-z2", "ds-z3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    MICRO,
    PEAK_FLOPS,
    SEQ,
    batch,
    ds_like_config,
    engine_step,
    init_single_process,  # noqa: E402
    write_jsonl,
)
from _common import model_flops_per_token  # noqa: E402


def build_model(device):
    from plait.layers import TransformerModel
    from plait.models import preset

    cfg = preset("llama-886m")
    model = TransformerModel(cfg, None, seed=0, device=device)
    return cfg, model


def make_step(arm, device):
    """Returns (cfg, n_params, step_fn(step) -> loss)."""
    cfg, model = build_model(device)
    n_params = cfg.num_parameters()
    if arm in ("plain", "fsdp2"):
        autocast = arm == "plain"  # plain: fp32 params under autocast; FSDP2 casts params itself
        if arm == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            init_single_process()
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.layers.values():
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=1e-4,
            weight_decay=0.1,
            betas=(0.9, 0.95),
            **({"fused": True} if autocast else {"foreach": True}),
        )

        def step(i):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(**batch(cfg, device, i))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return cfg, n_params, step
    if arm.startswith("plait"):
        import plait
        from plait.parallel import ParallelMesh

        init_single_process()
        engine = plait.initialize(model, ds_like_config(int(arm[-1])), mesh=ParallelMesh())
        return cfg, n_params, engine_step(engine, cfg, device)
    if arm.startswith("ds"):
        import deepspeed

        init_single_process()
        conf = ds_like_config(int(arm[-1]))
        conf["zero_allow_untested_optimizer"] = True
        del conf["optimizer"]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
        return cfg, n_params, engine_step(engine, cfg, device)
    raise ValueError(f"unknown arm {arm!r}; use one of {ARMS}")


def run_arm(arm: str, warmup: int, steps: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0)
    cfg, n_params, step = make_step(arm, device)
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss = step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    tokens = MICRO * SEQ / dt
    return {
        "arm": arm,
        "tokens_per_s": tokens,
        "mfu": tokens * model_flops_per_token(cfg, n_params) / PEAK_FLOPS,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "step_s": dt,
        "loss": float(loss),
        "params": n_params,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="bench_llama_zero.jsonl")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_arm(args.one, args.warmup, args.steps)), flush=True)
        return
    rows = []
    for arm in args.arms.split(","):
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                arm,
                "--warmup",
                str(args.warmup),
                "--steps",
                str(args.steps),
            ],
            capture_output=True,
            text=True,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            rows.append({"arm": arm, "error": " | ".join(tail)})
        else:
            rows.append(json.loads(line[7:]))
        print(json.dumps(rows[-1]), flush=True)
    write_jsonl(args.out, rows)
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(
        f"\nllama-886m, seq {SEQ}, micro-batch {MICRO}, bf16, AdamW, clip 1.0; {name}; torch {torch.__version__}"
    )
    print("| arm | tokens/s | MFU | peak GiB | step s |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['arm']} | failed: {r['error'][:120]} | | | |")
        else:
            print(
                f"| {r['arm']} | {r['tokens_per_s'] / 1e3:.1f}k | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | "
                f"{r['step_s']:.3f} |"
            )


if __name__ == "__main__":
    main()
