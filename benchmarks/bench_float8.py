"""Issue 46: float8 training, plait's against plait's bf16 and against FSDP2 + torchao by hand, one GPU.

    PYTHONPATH=$PWD python benchmarks/bench_float8.py [--arms a,b,...] [--preset llama-5.9b] [--seq 4096]
        [--micro 1] [--stage 2] [--recompute N] [--steps 10] [--warmup 5] [--timeout 900] [--out bench_float8.jsonl]
    python benchmarks/bench_float8.py --dry-run     # CPU, llama-tiny, 2 steps per arm, no compile: does it run?
    python benchmarks/bench_float8.py --report a.jsonl ...

Every arm trains the same Llama shape (plait's preset, default "llama-5.9b": Llama-3-8B's blocks with a 32k
vocabulary) at sequence ``--seq`` and micro-batch ``--micro``, bf16 compute, AdamW (``_common``'s lr, betas,
weight decay, clipping 1.0), every block compiled (regional ``torch.compile``, inductor), the first
``--recompute`` blocks recomputed in backward (default: all), in a child process of its own:

- plait-bf16: ``TransformerModel`` through ``plait.initialize`` with ZeRO ``--stage`` and ``"compile"``.
- plait-fp8-tensorwise / plait-fp8-rowwise: the same ds_config with ``"fp8": {"enabled": true, "recipe": ...}``
  (plait's Column/RowParallelLinear in float8 through torchao; the head stays bf16).
- fsdp2-bf16 / fsdp2-fp8-tensorwise / fsdp2-fp8-rowwise: ``hand_llama.HandLlama`` converted by hand with
  torchao's ``convert_to_float8_training`` (head left out; tensorwise with ``enable_fsdp_float8_all_gather``, as
  torchtitan's float8 recipe), activation checkpointing (``checkpoint_wrapper``) and ``block.compile()`` per
  block, then FSDP2 (``fully_shard`` per block and root, bf16 params, fp32 reduce) at world size 1: torchtitan's
  order (float8, AC, compile, FSDP).

Reported per arm: tokens/s, peak GiB (``torch.cuda.max_memory_allocated`` over the timed steps), mean step time
after the warm-up, the first step's time (compilation), the last loss; ratios against plait-bf16 and against the
fsdp2 arm of the same recipe. Nothing here is a result until run on the GPU: ``--dry-run`` checks the script only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import BETAS, CLIP, LR, WEIGHT_DECAY, ds_like_config, run_arms, single_process_env  # noqa: E402

ARMS = (
    "plait-bf16",
    "plait-fp8-tensorwise",
    "plait-fp8-rowwise",
    "fsdp2-bf16",
    "fsdp2-fp8-tensorwise",
    "fsdp2-fp8-rowwise",
)


def recipe_of(arm: str) -> str | None:
    """ "tensorwise" / "rowwise" for a float8 arm, None for a bf16 one."""
    return arm.split("fp8-")[1] if "fp8-" in arm else None


def shape(args):
    """The preset, its rotary table long enough for ``--seq`` (the Llama presets hold 2048 positions)."""
    import dataclasses

    from plait.models import preset

    cfg = preset(args.preset)
    return dataclasses.replace(
        cfg, max_position_embeddings=max(cfg.max_position_embeddings, args.seq)
    )


def batch(cfg, device, step: int, args) -> dict:
    g = torch.Generator(device=device).manual_seed(step)
    ids = torch.randint(0, cfg.vocab_size, (args.micro, args.seq + 1), generator=g, device=device)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def init_group(device) -> None:
    """A one-rank process group: NCCL on the GPU, gloo for --dry-run on the CPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    single_process_env()
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def plait_arm(arm: str, cfg, device, args):
    import plait
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh

    config = ds_like_config(args.stage)
    config.update(
        train_micro_batch_size_per_gpu=args.micro,
        gradient_accumulation_steps=args.gas,
        activation_checkpointing={"number_checkpoints": args.recompute},
    )
    if not args.dry_run:
        config["compile"] = {"enabled": True, "backend": "inductor"}
    if recipe_of(arm):
        config["fp8"] = {"enabled": True, "recipe": recipe_of(arm)}
    init_group(device)
    model = TransformerModel(cfg, None, seed=0, device=device)
    engine = plait.initialize(model, config, mesh=ParallelMesh())

    def step(i):
        for j in range(
            args.gas
        ):  # one optimizer step: --gas micro-batches (engine.step steps at the last)
            loss = engine(**batch(cfg, device, i * args.gas + j, args))
            engine.backward(loss)
            engine.step()
        return loss

    return step


def fsdp2_arm(arm: str, cfg, device, args):
    """HandLlama: float8 by hand (torchao), activation checkpointing, compile, FSDP2 (torchtitan's order)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hand_llama import HandLlama, llama_shape

    with torch.device(device):
        model = HandLlama(**{k: getattr(cfg, k) for k in llama_shape}, init_std=cfg.init_std)
    recipe = recipe_of(arm)
    if recipe:
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        fp8 = Float8LinearConfig.from_recipe_name(recipe)
        fp8 = dataclasses.replace(
            fp8, emulate=device.type != "cuda", enable_fsdp_float8_all_gather=recipe == "tensorwise"
        )
        convert_to_float8_training(model, config=fp8, module_filter_fn=lambda m, fqn: fqn != "head")
    for i in range(min(args.recompute, len(model.blocks))):
        model.blocks[i] = checkpoint_wrapper(model.blocks[i])
    if not args.dry_run:
        for block in model.blocks:
            block.compile()
    init_group(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        betas=BETAS,
        fused=device.type == "cuda",
    )

    def step(i):
        for j in range(
            args.gas
        ):  # gradients summed over --gas micro-batches, as the engine averages
            loss = model(**batch(cfg, device, i * args.gas + j, args))
            (loss / args.gas).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def run_arm(arm: str, args) -> dict:
    """Warm up, then time ``args.steps`` steps; peak memory over the timed steps (GPU only)."""
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    cfg = shape(args)
    step = (plait_arm if arm.startswith("plait") else fsdp2_arm)(arm, cfg, device, args)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
        if i == 0:
            sync()
            first = time.perf_counter() - t0
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        loss = step(i)
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    return {
        "arm": arm,
        "tokens_per_s": args.micro * args.gas * args.seq / dt,
        "step_s": dt,
        "first_step_s": first if args.warmup else None,
        "loss": float(loss.detach()),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "preset": args.preset,
        "seq": args.seq,
        "micro": args.micro,
        "gas": args.gas,
        "stage": args.stage,
        "recompute": args.recompute,
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def report(rows) -> str:
    """A markdown table: tokens/s, peak GiB, step time, ratios against plait-bf16 and the fsdp2 peer."""
    ok = [r for r in rows if "tokens_per_s" in r]
    by = {r["arm"]: r for r in ok}
    if not ok:
        return "no successful arm\n" + "\n".join(f"{r['arm']}: {r.get('error')}" for r in rows)
    r0 = ok[0]
    recompute = "all" if r0["recompute"] >= 10**6 else r0["recompute"]
    mode = (
        "dry run: CPU, eager, emulated float8 -- not a measurement" if r0["dry_run"] else "compiled"
    )
    head = (
        f"{r0['preset']}, seq {r0['seq']}, micro-batch {r0['micro']}, gradient accumulation "
        f"{r0.get('gas', 1)}, plait ZeRO stage {r0['stage']}, blocks "
        f"recomputed: {recompute}, {mode}; {r0['device']}; torch {r0['torch']}"
    )
    out = [
        head,
        "",
        "| arm | tokens/s | peak GiB | step s | first step s | loss | x plait-bf16 | x fsdp2 peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['arm']} | failed: {r['error'][:300].replace('|', '/')} | | | | | | |")
            continue
        peer = (
            by.get(r["arm"].replace("plait-", "fsdp2-")) if r["arm"].startswith("plait-") else None
        )
        ratio = lambda base: f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""  # noqa: E731
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        first = "" if r["first_step_s"] is None else f"{r['first_step_s']:.1f}"
        out.append(
            f"| {r['arm']} | {r['tokens_per_s']:.0f} | {peak} | {r['step_s']:.3f} | {first} | {r['loss']:.3f} "
            f"| {ratio(by.get('plait-bf16'))} | {ratio(peer)} |"
        )
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--preset", default="llama-5.9b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument(
        "--gas",
        type=int,
        default=1,
        help="micro-batches per optimizer step (a step's time covers all)",
    )
    p.add_argument("--stage", type=int, default=2, help="plait's ZeRO stage")
    p.add_argument(
        "--recompute", type=int, default=10**6, help="blocks recomputed in backward (default: all)"
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900, help="seconds per arm")
    p.add_argument("--out", default="bench_float8.jsonl")
    p.add_argument(
        "--logs", metavar="DIR", help="each arm's output as DIR/ARM.log (default: OUT.ARM.log)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="CPU, llama-tiny, seq 64, 2 steps, no compile"
    )
    p.add_argument("--report", nargs="+", metavar="JSONL")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.preset, args.seq, args.micro, args.steps, args.warmup = "llama-tiny", 64, 2, 2, 1
    return args


def main():
    args = parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_arm(args.one, args)), flush=True)
        return
    if args.report:
        print(
            report(
                [json.loads(line) for path in args.report for line in open(path) if line.strip()]
            )
        )
        return
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {','.join(ARMS)}")
    if os.path.exists(args.out):
        os.remove(args.out)
    child = [
        "--preset",
        args.preset,
        "--seq",
        str(args.seq),
        "--micro",
        str(args.micro),
        "--gas",
        str(args.gas),
        "--stage",
        str(args.stage),
        "--recompute",
        str(args.recompute),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    child += ["--dry-run"] if args.dry_run else []
    print("\n" + report(run_arms(__file__, arms, args, child)))


if __name__ == "__main__":
    main()
