"""Issue 14: plait ZeRO-2/3 against FSDP2 and DeepSpeed ZeRO-3, data parallel over any number of GPUs.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/bench_zero.py --nproc 2 [--model llama-886m] [--micro 4]
        [--ac] [--arms a,b,...] [--steps 10] [--warmup N] [--timeout 400] [--out bench_zero.jsonl]
    python benchmarks/bench_zero.py --report a.jsonl b.jsonl        # tables of earlier runs, together

Each arm runs under ``torch.distributed.run --standalone --nproc-per-node N`` in a process group of its
own (fresh CUDA memory statistics; a failure or a run past --timeout becomes a row with its error). Every
rank trains the preset's shape (``plait.models.preset(--model)``), sequence 2048, ``--micro`` sequences
per rank, bf16, AdamW lr 1e-4 wd 0.1 betas 0.9/0.95, clipping 1.0; ``--ac`` recomputes every block in
backward (activation checkpointing per block):

- fsdp2 / fsdp2-compile: ``hand_llama.HandLlama`` (plain torch) with ``fully_shard`` per block and on the
  root (MixedPrecisionPolicy bf16 parameters, fp32 reduce; reshard after forward, FSDP2's default), fused
  torch AdamW on the sharded fp32 parameters; -compile compiles each block first (regional, as torchtitan);
  --ac wraps each block in torch's ``checkpoint_wrapper`` first.
- ds-z3 / ds-z2: DeepSpeed 0.19.8 on the same model (bf16, torch AdamW; ``benchmarks/_common.ds_like_config``).
- plait-z3 / plait-z2 and -compile: plait's TransformerModel through ``plait.initialize`` with the same
  ds_config (``"compile"`` on for -compile; ``activation_checkpointing`` for --ac); plait-z3-keep: ZeRO-3
  with ``reshard_after_forward: false``; plait-z3-bf16reduce: ZeRO-3 with ``communication_data_type: bf16``.

Reported per arm: tokens/s per GPU (rank 0's mean step time after the warm-up), MFU = tokens/s x (6N + 6 x
layers x hidden x seq) / 989e12, peak GiB (the largest ``torch.cuda.max_memory_allocated`` over the ranks,
over the timed steps), and rank 0's parts of the peak (``_memory.py``); in the JSON line also each timed
step's GPU time (CUDA events, ``step_ms``), the allocator's retries and the cyclic garbage collector's pauses
of 1 ms or more. ``--gc freeze`` collects and freezes (``gc.freeze``) after the warm-up in every arm, so a full
collection of the start-up's objects cannot land inside the few timed steps of one arm and not another's.
``--profile DIR`` then profiles two more steps (``_timeline.py``: compute, communication, exposed
communication, idle gaps; rank 0's trace in DIR).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import BETAS, LR, PEAK_FLOPS, SEQ, WEIGHT_DECAY, ds_like_config  # noqa: E402
from _common import (
    child_or_report,
    engine_step,
    fsdp2_wrap,
    known_arms,
    model_flops_per_token,
    run_arms,
)  # noqa: E402
from _common import timed_steps, torch_step  # noqa: E402

ARMS = (
    "fsdp2",
    "fsdp2-compile",
    "ds-z3",
    "ds-z2",
    "plait-z3",
    "plait-z2",
    "plait-z3-compile",
    "plait-z2-compile",
    "plait-z3-keep",
    "plait-z3-bf16reduce",
)
PART_KEYS = ("params", "grads", "master", "optimizer_state", "activations", "resident")


def init_distributed() -> torch.device:
    """NCCL over the ranks torchrun started; this rank's GPU."""
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    return device


def torch_model(cfg, device, ac: bool, compiled: bool):
    """``HandLlama`` at ``cfg``'s shape (same parameter count as plait's), blocks wrapped for AC and compiled."""
    from hand_llama import HandLlama, llama_shape

    with torch.device(device):
        model = HandLlama(**{k: getattr(cfg, k) for k in llama_shape}, init_std=cfg.init_std)
    n = sum(p.numel() for p in model.parameters())
    assert n == cfg.num_parameters(), (
        f"hand-written model has {n:,} parameters, plait's {cfg.num_parameters():,}"
    )
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if compiled:
        for block in model.blocks:
            block.compile(fullgraph=True)
    return model, n


def fsdp2_arm(arm, cfg, device, args):
    from _memory import tensor_parts

    model, n = torch_model(cfg, device, args.ac, arm.endswith("-compile"))
    fsdp2_wrap(model)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, fused=True
    )
    return (
        torch_step(model, opt, cfg, device, args.micro),
        lambda: tensor_parts(model.parameters(), [opt]),
        n,
    )


def run_config(arm, args, num_layers: int) -> dict:
    """The ds_config of the DeepSpeed and plait arms."""
    conf = ds_like_config(int(arm.split("-")[1][1]))
    conf["train_micro_batch_size_per_gpu"] = args.micro
    if args.ac:
        conf["activation_checkpointing"] = {"number_checkpoints": num_layers}  # every block
    if arm.endswith("-compile"):
        conf["compile"] = {"enabled": True, "backend": "inductor", "kwargs": {}}
    if arm.endswith("-keep"):
        conf["zero_optimization"]["reshard_after_forward"] = False
    if arm.endswith("-bf16reduce"):
        conf["communication_data_type"] = "bf16"
    return conf


def ds_arm(arm, cfg, device, args):
    import deepspeed

    from _memory import tensor_parts

    model, n = torch_model(cfg, device, args.ac, False)
    conf = run_config(arm, args, cfg.num_layers)
    conf.pop("activation_checkpointing", None)  # the blocks are wrapped already
    conf["zero_allow_untested_optimizer"] = True
    del conf["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    parts = lambda: tensor_parts(engine.module.parameters(), [inner])  # noqa: E731
    return engine_step(engine, cfg, device, args.micro), parts, n


def plait_arm(arm, cfg, device, args):
    import plait
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh

    from _memory import plait_parts

    model = TransformerModel(cfg, None, seed=0, device=device)
    engine = plait.initialize(model, run_config(arm, args, cfg.num_layers), mesh=ParallelMesh())
    return (
        engine_step(engine, cfg, device, args.micro),
        lambda: plait_parts(engine),
        cfg.num_parameters(),
    )


def make_arm(arm, cfg, device, args):
    if arm.startswith("fsdp2"):
        return fsdp2_arm(arm, cfg, device, args)
    if arm.startswith("ds-"):
        return ds_arm(arm, cfg, device, args)
    if arm.startswith("plait-"):
        return plait_arm(arm, cfg, device, args)
    raise ValueError(f"unknown arm {arm!r}; use one of {ARMS}")


def model_config(args):
    """The preset ``--model``, with ``--layers`` blocks when given (to find the largest model that fits)."""
    from plait.models import preset

    return preset(args.model, num_layers=args.layers) if args.layers else preset(args.model)


def run_arm(arm: str, args) -> dict | None:
    """On every rank: warm up, time ``--steps`` steps, one more step for the parts; rank 0's row."""
    import torch.distributed as dist

    import _memory

    torch.backends.cuda.matmul.allow_tf32 = True
    device, cfg = init_distributed(), model_config(args)
    warmup = args.warmup if args.warmup is not None else (5 if "compile" in arm else 3)
    if args.snapshot:
        _memory.start_recording()
    step, parts_fn, n_params = make_arm(arm, cfg, device, args)
    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if args.snapshot:
        folder = os.path.join(args.snapshot, f"rank{dist.get_rank()}")
        return {
            **_memory.snapshot_step(arm, step, warmup, folder),
            "model": model_name(args),
            "ac": args.ac,
        }
    torch.cuda.reset_peak_memory_stats()
    timed = timed_steps(step, warmup, args.steps, args.gc)
    loss, dt = timed["loss"], timed["step_s"]
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    parts = _memory.measure_parts(step, warmup + args.steps, parts_fn, int(peak.item()))
    tokens = args.micro * SEQ / dt
    row = {
        "arm": arm,
        "model": model_name(args),
        "micro": args.micro,
        "ac": args.ac,
        "world": dist.get_world_size(),
        "tokens_per_s_gpu": tokens,
        "mfu": tokens * model_flops_per_token(cfg, n_params) / PEAK_FLOPS,
        "peak_gib": peak.item() / 2**30,
        "step_s": dt,
        "warmup_s": first,
        "loss": float(loss.detach()),
        "step_ms": timed["step_ms"],
        "gc_pauses_ms": timed["gc_pauses_ms"],
        "gc": args.gc,
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
        "params": n_params,
        "steps": args.steps,
        "warmup": warmup,
        "parts": parts,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }
    if args.profile:
        from _timeline import format_summary, profile_timeline

        tag = f"{arm}{'-ac' if args.ac else ''}"
        trace = os.path.join(args.profile, f"{tag}.trace.json.gz") if dist.get_rank() == 0 else None
        row["timeline"] = profile_timeline(step, warmup + args.steps + 1, trace)
        if trace:
            print(format_summary(arm, row["timeline"]), flush=True)
    return row


def model_name(args) -> str:
    return f"{args.model} with {args.layers} layers" if args.layers else args.model


def ratio(row, base) -> str:
    if base is None or "tokens_per_s_gpu" not in row or "tokens_per_s_gpu" not in base:
        return ""
    return f"{row['tokens_per_s_gpu'] / base['tokens_per_s_gpu']:.3f}"


def report(rows) -> str:
    """Markdown: throughput and memory per (model, micro, ac, world), ratios against FSDP2 and DeepSpeed
    ZeRO-3 of the same run; then the parts of each peak."""
    out = []
    keys = []
    for r in rows:
        key = (r.get("model"), r.get("micro"), r.get("ac"), r.get("world"))
        if key not in keys:
            keys.append(key)
    for key in keys:
        group = [
            r for r in rows if (r.get("model"), r.get("micro"), r.get("ac"), r.get("world")) == key
        ]
        ok = [r for r in group if "device" in r]
        by = {r["arm"]: r for r in ok}
        params = f" ({ok[0]['params'] / 1e9:.2f}B parameters)" if ok else ""
        ac = "on" if key[2] else "off"
        out += [
            f"{key[0]}{params}, seq {SEQ}, micro-batch {key[1]} per GPU, activation checkpointing {ac}, "
            f"dp={key[3]}, bf16, AdamW, clip 1.0; {ok[0]['device'] if ok else '?'} x {key[3]}; "
            f"torch {ok[0]['torch'] if ok else '?'}",
            "",
            "| arm | tokens/s/GPU | MFU | peak GiB | step s | x fsdp2 | x fsdp2-compile | x ds-z3 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            if "error" in r:
                out.append(
                    f"| {r['arm']} | failed: {r['error'][:300].replace('|', '/')} | | | | | | |"
                )
                continue
            out.append(
                f"| {r['arm']} | {r['tokens_per_s_gpu'] / 1e3:.2f}k | {100 * r['mfu']:.1f}% | "
                f"{r['peak_gib']:.2f} | {r['step_s']:.3f} | {ratio(r, by.get('fsdp2'))} | "
                f"{ratio(r, by.get('fsdp2-compile'))} | {ratio(r, by.get('ds-z3'))} |"
            )
        out += [
            "",
            "Parts of rank 0's peak, GiB (activations: the peak minus the four before it, buffers "
            "included; resident: allocated between steps)",
            "",
            "| arm | peak | " + " | ".join(PART_KEYS) + " |",
            "|---" * (len(PART_KEYS) + 2) + "|",
        ]
        for r in ok:
            out.append(
                f"| {r['arm']} | {r['peak_gib']:.2f} | "
                + " | ".join(f"{r['parts'][k] / 2**30:.2f}" for k in PART_KEYS)
                + " |"
            )
        out.append("")
    return "\n".join(out)


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arms", default="fsdp2,ds-z3,plait-z3,plait-z2")
    p.add_argument("--nproc", type=int, default=2, help="GPUs (ranks) per arm")
    p.add_argument(
        "--model", default="llama-886m", help="a plait preset, e.g. llama-886m or llama-5.9b"
    )
    p.add_argument("--layers", type=int, default=None, help="blocks instead of the preset's number")
    p.add_argument("--micro", type=int, default=4, help="sequences of 2048 tokens per GPU per step")
    p.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    p.add_argument(
        "--warmup", type=int, default=None, help="default: 5 for compiled arms, 3 otherwise"
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=400, help="seconds per arm")
    p.add_argument("--out", default="bench_zero.jsonl")
    p.add_argument(
        "--logs", metavar="DIR", help="each arm's output as DIR/ARM.log (default: OUT.ARM.log)"
    )
    p.add_argument(
        "--snapshot", metavar="DIR", help="record one step's allocations per arm instead of timing"
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after timing, profile two steps: rank 0's trace in DIR, "
        "its summary (benchmarks/_timeline.py) in the row",
    )
    p.add_argument(
        "--gc",
        choices=("auto", "freeze"),
        default="auto",
        help="freeze: gc.collect() and gc.freeze() "
        "after the warm-up (Python's cyclic collector then scans only newer objects)",
    )
    p.add_argument(
        "--report", nargs="+", metavar="JSONL", help="print the tables of earlier runs and exit"
    )
    p.add_argument("--one", help=argparse.SUPPRESS)
    return p.parse_args()


def child_args(args) -> list[str]:
    out = ["--model", args.model, "--micro", str(args.micro), "--steps", str(args.steps)]
    out += ["--layers", str(args.layers)] if args.layers else []
    out += [] if args.warmup is None else ["--warmup", str(args.warmup)]
    out += ["--snapshot", args.snapshot] if args.snapshot else []
    out += ["--profile", args.profile] if args.profile else []
    out += ["--gc", args.gc]
    return out + (["--ac"] if args.ac else [])


def main():
    args = parse_args()
    if child_or_report(args, run_arm, report):
        return
    arms = known_arms(args.arms, ARMS)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    tags = {"model": model_name(args), "micro": args.micro, "ac": args.ac, "world": args.nproc}
    rows = run_arms(__file__, arms, args, child_args(args), launcher, tags)
    if args.snapshot:
        print(
            "\n".join(
                f"{r['arm']}: peak {r.get('peak_gib', 0):.2f} GiB, {r.get('snapshot', r)}"
                for r in rows
            )
        )
        return
    print("\n" + report(rows))


if __name__ == "__main__":
    main()
