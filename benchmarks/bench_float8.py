"""Issue 46: float8 training, plait's against plait's bf16, torchtitan's float8 and FSDP2 + torchao by hand, on
one GPU or ``--nproc`` GPUs of one host (each arm under ``torch.distributed.run``).

    PYTHONPATH=$PWD python benchmarks/bench_float8.py [--arms a,b,...] [--preset llama-5.9b] [--seq 4096]
        [--micro 1] [--gas 1] [--stage 2] [--recompute N] [--steps 10] [--warmup 5] [--timeout 900] [--out bench_float8.jsonl]
        [--nproc 1]
    # ZeRO-3's two parameter gathers of the float8 layers' weights, bf16 and float8, over 2 GPUs:
    PYTHONPATH=$PWD python benchmarks/bench_float8.py --nproc 2 --stage 3 \
        --arms plait-fp8-tensorwise,plait-fp8-tensorwise-f8gather,fsdp2-fp8-tensorwise
    python benchmarks/bench_float8.py --dry-run     # CPU, llama-tiny, 2 steps per arm, no compile: does it run?
    python benchmarks/bench_float8.py --report a.jsonl ...

Every arm trains the same Llama shape (plait's preset, default "llama-5.9b": hidden 4096, 32 layers, GQA 32/8, ffn 11008, 32k
vocabulary) at sequence ``--seq`` and micro-batch ``--micro``, bf16 compute, AdamW (``_common``'s lr, betas,
weight decay, clipping 1.0), every block compiled (regional ``torch.compile``, inductor), the first
``--recompute`` blocks recomputed in backward (default: all), in a child process of its own:

- plait-bf16: ``TransformerModel`` through ``plait.initialize`` with ZeRO ``--stage`` and ``"compile"``.
- plait-fp8-tensorwise / plait-fp8-rowwise: the same ds_config with ``"fp8": {"enabled": true, "recipe": ...}``
  (plait's Column/RowParallelLinear in float8 through torchao; the head stays bf16).
- plait-fp8-tensorwise-f8gather: plait-fp8-tensorwise with ``"float8_all_gather": true`` (needs ``--stage 3``):
  ZeRO-3 gathers the float8 layers' weights as float8, one byte an element (``plait.precision.float8_gather``);
  against plait-fp8-tensorwise at ``--stage 3`` it measures both gathers (with ``--nproc`` > 1: at one rank
  nothing is gathered).
- fsdp2-bf16 / fsdp2-fp8-tensorwise / fsdp2-fp8-rowwise: ``hand_llama.HandLlama`` converted by hand with
  torchao's ``convert_to_float8_training`` (head left out; tensorwise with ``enable_fsdp_float8_all_gather``, as
  torchtitan's float8 recipe), activation checkpointing (``checkpoint_wrapper``) and ``block.compile()`` per
  block, then FSDP2 (``fully_shard`` per block and root, bf16 params, fp32 reduce) at world size 1: torchtitan's
  order (float8, AC, compile, FSDP).
- titan-bf16 / titan-fp8-rowwise / titan-fp8-tensorwise: torchtitan's own Trainer (``_float8_titan.py`` says
  how; its CUDA graphs unless --titan-no-cuda-graphs); torchtitan 0.3.0 refuses tensorwise (its recipes are
  rowwise and rowwise_with_gw_hp), so that arm's row names the refusal and fsdp2 stays the tensorwise peer.

Reported per arm: tokens/s (all ranks), peak GiB (``torch.cuda.max_memory_allocated`` of rank 0 over the timed
steps), mean step time after the warm-up, the first step's time (compilation), the last loss, and for plait's arms
the GiB rank 0's parameter all-gathers received per step (counted at the collective), for torchtitan's arms
its version and Float8Linear count; ratios against plait-bf16 and against the peer of the same recipe
(torchtitan's arm where it ran, else fsdp2's). Nothing here is a result until run on the GPU: ``--dry-run`` checks the script only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import (  # noqa: E402
    BETAS,
    CLIP,
    LR,
    WEIGHT_DECAY,
    child_or_report,
    ds_like_config,
    fsdp2_wrap,
    chosen_arms,
    run_arms,
    single_process_env,
)

ARMS = (
    "plait-bf16",
    "plait-fp8-tensorwise",
    "plait-fp8-rowwise",
    "plait-fp8-tensorwise-f8gather",
    "fsdp2-bf16",
    "fsdp2-fp8-tensorwise",
    "fsdp2-fp8-rowwise",
    "titan-bf16",
    "titan-fp8-tensorwise",
    "titan-fp8-rowwise",
)


def recipe_of(arm: str) -> str | None:
    """ "tensorwise" / "rowwise" for a float8 arm, None for a bf16 one."""
    return arm.split("fp8-")[1].removesuffix("-f8gather") if "fp8-" in arm else None


def peer_of(arm: str, measured) -> str | None:
    """The peer of a plait arm's recipe among the ``measured`` arms: torchtitan's arm, else fsdp2's (its
    tensorwise arm gathers in float8 anyway); None for other arms or when neither was measured."""
    if not arm.startswith("plait-"):
        return None
    base = arm.removeprefix("plait-").removesuffix("-f8gather")
    return next((p for p in (f"titan-{base}", f"fsdp2-{base}") if p in measured), None)


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
    """The process group (torchrun's, else one rank): NCCL on the GPU, gloo for --dry-run on the CPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    single_process_env()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def count_gathers(received: list) -> None:
    """Add the bytes each ZeRO parameter all-gather of this rank receives to ``received[0]``."""
    import plait.zero.comm as zero_comm

    plain = zero_comm.all_gather_flat

    def counting(out, x, *args, **kwargs):
        received[0] += out.numel() * out.element_size()
        return plain(out, x, *args, **kwargs)

    zero_comm.all_gather_flat = counting


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
    else:  # llama-tiny's weights are under the persistence threshold: gather them all the same
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if recipe_of(arm):
        config["fp8"] = {"enabled": True, "recipe": recipe_of(arm)}
        config["fp8"]["float8_all_gather"] = arm.endswith("-f8gather")
    init_group(device)
    model = TransformerModel(cfg, None, seed=0, device=device)
    engine = plait.initialize(model, config, mesh=ParallelMesh())

    def step(i):
        # one optimizer step: --gas micro-batches (engine.step steps at the last)
        for j in range(args.gas):
            loss = engine(**batch(cfg, device, i * args.gas + j, args))
            engine.backward(loss)
            engine.step()
        return loss

    step.gathered = [0]  # bytes received by this rank's parameter all-gathers
    count_gathers(step.gathered)
    return step


def fsdp2_arm(arm: str, cfg, device, args):
    """HandLlama: float8 by hand (torchao), activation checkpointing, compile, FSDP2 (torchtitan's order)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

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
    fsdp2_wrap(model)  # per block and root, bf16 parameters, fp32 reduction
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        betas=BETAS,
        fused=device.type == "cuda",
    )

    def step(i):
        # gradients summed over --gas micro-batches, averaged as the engine averages them
        for j in range(args.gas):
            loss = model(**batch(cfg, device, i * args.gas + j, args))
            (loss / args.gas).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def run_arm(arm: str, args, build=None) -> dict:
    """Warm up, then time ``args.steps`` steps; peak memory over the timed steps (GPU only). ``build(arm, cfg,
    device, args) -> step`` builds a non-torchtitan arm (default: plait_arm / fsdp2_arm); ``step.row`` joins the row."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", local)
    cfg = shape(args)
    extra = {}  # an arm's own row fields
    if arm.startswith("titan-"):
        from _float8_titan import titan_arm, titan_dry_run

        if args.dry_run:
            return titan_dry_run(arm, cfg, recipe_of(arm), args)
        step, extra = titan_arm(arm, cfg, recipe_of(arm), args)
    else:
        build = build or (plait_arm if arm.startswith("plait") else fsdp2_arm)
        step = build(arm, cfg, device, args)
        extra = getattr(step, "row", {})
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
    gathered = getattr(step, "gathered", None)
    if gathered is not None:
        gathered[0] = 0
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        loss = step(i)
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return {
        "arm": arm,
        "tokens_per_s": world * args.micro * args.gas * args.seq / dt,
        "gathered_gib_per_step": None if gathered is None else gathered[0] / args.steps / 2**30,
        "nproc": world,
        "step_s": dt,
        "first_step_s": first if args.warmup else None,
        "loss": float(loss.detach() if torch.is_tensor(loss) else loss),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "preset": args.preset,
        "seq": args.seq,
        "micro": args.micro,
        "gas": args.gas,
        "stage": args.stage,
        "recompute": args.recompute,
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        **extra,
    }


def report(rows) -> str:
    """A markdown table: tokens/s, peak GiB, step time, gathered GiB per step, ratios against plait-bf16 and
    the peer of the recipe (``peer_of``); torchtitan's arms give its version and Float8Linear count."""
    ok = [r for r in rows if "tokens_per_s" in r]
    by = {r["arm"]: r for r in ok}
    if not ok:
        why = lambda r: r.get("error") or f"not run: {r.get('not_run')}"  # noqa: E731
        return "no measured arm\n" + "\n".join(f"{r['arm']}: {why(r)}" for r in rows)
    r0 = ok[0]
    recompute = "all" if r0["recompute"] >= 10**6 else r0["recompute"]
    mode = (
        "dry run: CPU, eager, emulated float8 -- not a measurement" if r0["dry_run"] else "compiled"
    )
    head = (
        f"{r0['preset']}, seq {r0['seq']}, micro-batch {r0['micro']}, gradient accumulation "
        f"{r0.get('gas', 1)}, plait ZeRO stage {r0['stage']}, blocks recomputed: {recompute}, {mode}; "
        f"{r0.get('nproc', 1)} x {r0['device']}; torch {r0['torch']}"
    )
    out = [
        head,
        "",
        (
            "| arm | tokens/s | peak GiB | step s | first step s | loss | gathered GiB/step "
            "| x plait-bf16 | peer | x peer |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r or "not_run" in r:
            why = f"failed: {r['error']}" if "error" in r else f"not run: {r['not_run']}"
            out.append(f"| {r['arm']} | {why[:300].replace('|', '/')} | | | | | | | | |")
            continue
        peer = by.get(peer_of(r["arm"], by))
        arm = r["arm"]
        if "torchtitan" in r:
            arm += f" (torchtitan {r['torchtitan']}, {r['float8_linears']} Float8Linear)"
        ratio = lambda base: f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""  # noqa: E731
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        first = "" if r["first_step_s"] is None else f"{r['first_step_s']:.1f}"
        gathered = r.get("gathered_gib_per_step")
        gathered = "" if gathered is None else f"{gathered:.3f}"
        out.append(
            f"| {arm} | {r['tokens_per_s']:.0f} | {peak} | {r['step_s']:.3f} | {first} | {r['loss']:.3f} "
            f"| {gathered} | {ratio(by.get('plait-bf16'))} | {peer['arm'] if peer else ''} "
            f"| {ratio(peer)} |"
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
        "--nproc", type=int, default=1, help="GPUs (ranks) per arm, under torch.distributed.run"
    )
    p.add_argument(
        "--recompute", type=int, default=10**6, help="blocks recomputed in backward (default: all)"
    )
    p.add_argument(
        "--titan-no-cuda-graphs",
        action="store_true",
        help="torchtitan's arms without its CUDA graphs (on by default, as torchtitan runs)",
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
    if child_or_report(args, run_arm, report):
        return
    arms = chosen_arms(args, ARMS)
    # the child's flags: the shape and schedule, the same for every arm
    names = ("preset", "seq", "micro", "gas", "stage", "recompute", "steps", "warmup")
    child = [x for name in names for x in (f"--{name}", str(getattr(args, name)))]
    child += ["--dry-run"] if args.dry_run else []
    child += ["--titan-no-cuda-graphs"] if args.titan_no_cuda_graphs else []
    launcher = []
    if args.nproc > 1:
        launcher = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.nproc),
        ]
    print("\n" + report(run_arms(__file__, arms, args, child, launcher=launcher)))


if __name__ == "__main__":
    main()
