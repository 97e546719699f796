"""Issue 13: plait's training step beside torch.compile's, llama-886m on one GPU, time and memory.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/bench_compile.py [--arms a,b,...] [--steps 10] [--warmup N]
        [--timeout 240] [--out bench_compile.jsonl] [--logs DIR] [--no-plait-fused] [--snapshot DIR]
    python benchmarks/bench_compile.py --report a.jsonl b.jsonl     # tables of earlier runs, together
    python benchmarks/bench_compile.py --top DIR/ARM.pickle            # largest live tensors at the peak

Every arm trains plait's preset "llama-886m" shape (sequence 2048, micro-batch 4, bf16, AdamW lr 1e-4
wd 0.1 betas 0.9/0.95, clipping 1.0, no activation checkpointing) in a child process of its own
(fresh CUDA memory statistics; a failure or a run past --timeout becomes a row with its error):

- hand-eager / hand-compile: ``hand_llama.HandLlama`` (plain torch, independent of plait), fp32
  parameters under torch.autocast bf16, fused torch AdamW, clip_grad_norm_; -compile compiles each
  block (``block.compile(fullgraph=True)``, regional compilation as torchtitan does).
- fsdp2 / fsdp2-compile: the same model under FSDP2 at world size 1 (``fully_shard`` per block and the
  root, MixedPrecisionPolicy bf16 params / fp32 reduce), blocks compiled before wrapping for -compile.
- ds-z2 / ds-z3: DeepSpeed ZeRO-2/3 on the same model (bf16, torch AdamW).
- torchtitan / torchtitan-nocg: torchtitan 0.3's Trainer at this shape (``_titan.py`` says how), with
  and without its CUDA graphs.
- plait-z{1,2,3} and plait-z{1,2,3}-compile: plait's TransformerModel through ``plait.initialize``,
  the ds_config of ``plait_config`` (``"compile"`` on for -compile), plait's defaults (one matmul per
  projection, unfused loss); ``PLAIT_MODEL_OVERRIDES`` (JSON, e.g. ``{"fused_projections":
  true}`` or ``{"fused_loss_chunk_tokens": 2048}``) are applied to the preset unless --no-plait-fused.

Reported per arm: tokens/s, MFU = tokens/s x (6N + 6 x layers x hidden x seq) / 989e12, peak GiB
(torch.cuda.max_memory_allocated over the timed steps), mean step time after the warm-up steps (5
for compiled arms, 3 otherwise, unless --warmup), the first step's time (compilation), the last
step's loss (random init: about 10.4 to 10.8; ln 32000 = 10.37), and the peak's parts (``_memory.py``). --snapshot DIR
instead records the CUDA allocator's history of each chosen arm through its warm-up and one step,
dumps DIR/ARM.pickle and writes the 20 largest allocations live at the peak to DIR/ARM.top20.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import BETAS, LR, MICRO, PEAK_FLOPS, SEQ, WEIGHT_DECAY, ds_like_config  # noqa: E402
from _common import engine_step, init_single_process, model_flops_per_token, run_arms  # noqa: E402
from _common import fsdp2_wrap, single_process_env, torch_step  # noqa: E402

#: TransformerConfig fields replaced in the plait arms' preset (unless --no-plait-fused): the environment
#: variable PLAIT_MODEL_OVERRIDES (JSON); none by default
PLAIT_MODEL_OVERRIDES: dict = json.loads(os.environ.get("PLAIT_MODEL_OVERRIDES", "{}"))

PRESET = "llama-886m"
ARMS = (
    "hand-eager",
    "hand-compile",
    "fsdp2",
    "fsdp2-compile",
    "ds-z2",
    "ds-z3",
    "torchtitan",
    "torchtitan-nocg",
    "plait-z1",
    "plait-z2",
    "plait-z3",
    "plait-z1-compile",
    "plait-z2-compile",
    "plait-z3-compile",
)
PART_KEYS = ("params", "grads", "master", "optimizer_state", "activations", "resident")


def is_compiled(arm: str) -> bool:
    return arm.endswith("-compile") or arm.startswith("torchtitan")


def plait_config(stage: int, compile_on: bool) -> dict:
    """The ds_config of the plait arms (DeepSpeed's keys, as the ds arms)."""
    config = ds_like_config(stage)
    if compile_on:
        config["compile"] = {"enabled": True, "backend": "inductor", "kwargs": {}}
    return config


def shape_config():
    from plait.models import preset

    return preset(PRESET)


def hand_model(cfg, device):
    """``HandLlama`` at ``cfg``'s shape; its parameter count must be plait's."""
    from hand_llama import HandLlama, llama_shape

    if cfg.tie_embeddings:
        raise ValueError(f"{PRESET} ties its embeddings; the hand-written model has an untied head")
    with torch.device(device):
        model = HandLlama(**{k: getattr(cfg, k) for k in llama_shape}, init_std=cfg.init_std)
    n, expected = sum(p.numel() for p in model.parameters()), cfg.num_parameters()
    print(f"parameters: hand-written {n:,}, plait {PRESET} {expected:,}", flush=True)
    assert n == expected, f"hand-written model has {n:,} parameters, plait's {PRESET} {expected:,}"
    return model, n


def torch_arm(arm, cfg, device):
    """hand-eager, hand-compile, fsdp2, fsdp2-compile."""
    from _memory import tensor_parts

    model, n = hand_model(cfg, device)
    fsdp = arm.startswith("fsdp2")
    if arm.endswith("-compile"):
        for block in model.blocks:
            block.compile(fullgraph=True)
    if fsdp:
        init_single_process()
        fsdp2_wrap(model)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, fused=True
    )
    step = torch_step(model, opt, cfg, device, autocast=not fsdp)  # FSDP2 casts params itself
    return step, lambda: tensor_parts(model.parameters(), [opt]), n


def ds_arm(arm, cfg, device):
    import deepspeed

    from _memory import tensor_parts

    model, n = hand_model(cfg, device)
    init_single_process()
    conf = ds_like_config(int(arm[-1]))
    conf["zero_allow_untested_optimizer"] = True
    del conf["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return (
        engine_step(engine, cfg, device),
        lambda: tensor_parts(engine.module.parameters(), [inner]),
        n,
    )


def plait_model_config(cfg, fused: bool):
    return (
        dataclasses.replace(cfg, **PLAIT_MODEL_OVERRIDES)
        if fused and PLAIT_MODEL_OVERRIDES
        else cfg
    )


def plait_arm(arm, cfg, device, fused: bool):
    import plait
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh

    from _memory import plait_parts

    pcfg = plait_model_config(cfg, fused)
    print(f"plait model overrides: {PLAIT_MODEL_OVERRIDES if pcfg is not cfg else {}}", flush=True)
    model = TransformerModel(pcfg, None, seed=0, device=device)
    init_single_process()
    stage = int(arm.split("-")[1][1])
    engine = plait.initialize(
        model, plait_config(stage, arm.endswith("-compile")), mesh=ParallelMesh()
    )
    return engine_step(engine, pcfg, device), lambda: plait_parts(engine), pcfg.num_parameters()


def titan_arm(arm, cfg, total_steps: int):
    try:
        from _titan import make_titan
    except ImportError as e:
        raise ImportError(
            f"torchtitan 0.3 is not importable ({e}): install .whl/ (torchtitan 0.3.0, spmd_types, "
            "tyro, docstring_parser, typeguard, torchdata, torch_checkpointing) with pip --target"
        ) from e
    single_process_env()
    run = make_titan(cfg, micro=MICRO, seq=SEQ, steps=total_steps, cuda_graphs=arm == "torchtitan")
    step, parts, n = run.step, run.parts, run.n_params
    expected = cfg.num_parameters()
    assert n == expected, f"torchtitan's model has {n:,} parameters, plait's {PRESET} {expected:,}"
    return step, parts, n


def make_arm(arm, cfg, device, args, total_steps):
    """``(step(i, probe=None) -> loss, parts() -> bytes by kind, parameter count)`` of one arm."""
    if arm.startswith(("hand-", "fsdp2")):
        return torch_arm(arm, cfg, device)
    if arm.startswith("ds-"):
        return ds_arm(arm, cfg, device)
    if arm.startswith("plait-"):
        return plait_arm(arm, cfg, device, args.plait_fused)
    if arm.startswith("torchtitan"):
        return titan_arm(arm, cfg, total_steps)
    raise ValueError(f"unknown arm {arm!r}; use one of {ARMS}")


def run_arm(arm: str, args) -> dict:
    """Warm up, time ``args.steps`` steps, then one more step for the memory parts (or a snapshot)."""
    import _memory

    torch.backends.cuda.matmul.allow_tf32 = True
    device, cfg = torch.device("cuda", 0), shape_config()
    warmup = args.warmup if args.warmup is not None else (5 if is_compiled(arm) else 3)
    if args.snapshot:
        _memory.start_recording()
    step, parts_fn, n_params = make_arm(arm, cfg, device, args, warmup + args.steps + 1)
    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
        if i == 0:
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
    graphs = compiled_graphs()
    if is_compiled(arm) and warmup and not graphs:
        raise RuntimeError(
            f"{arm}: no torch.compile graph after {warmup} warm-up steps (for plait: does "
            "plait.initialize compile the blocks for the ds_config key 'compile'?)"
        )
    if args.snapshot:
        return _memory.snapshot_step(arm, step, warmup, args.snapshot)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + args.steps):
        loss = step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated()
    parts = _memory.measure_parts(step, warmup + args.steps, parts_fn, peak)
    tokens = MICRO * SEQ / dt
    return {
        "arm": arm,
        "tokens_per_s": tokens,
        "mfu": tokens * model_flops_per_token(cfg, n_params) / PEAK_FLOPS,
        "peak_gib": peak / 2**30,
        "step_s": dt,
        "first_step_s": first if warmup else None,
        "loss": None if loss is None else float(loss.detach() if torch.is_tensor(loss) else loss),
        "params": n_params,
        "warmup": warmup,
        "graphs": graphs,
        "overrides": PLAIT_MODEL_OVERRIDES if arm.startswith("plait") and args.plait_fused else {},
        "steps": args.steps,
        "parts": parts,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process (dynamo's count; 0 without compilation)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def ratio(row, base) -> str:
    if base is None or "tokens_per_s" not in row or "tokens_per_s" not in base:
        return ""
    return f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}"


def report(rows) -> str:
    """The markdown tables: throughput and memory, then the parts of each arm's peak."""
    ok = [r for r in rows if "device" in r]
    head = (
        f"llama-886m, seq {SEQ}, micro-batch {MICRO}, bf16, AdamW, clip 1.0, no activation checkpointing; "
        f"{ok[0]['device'] if ok else 'device unknown'}; torch {ok[0]['torch'] if ok else torch.__version__}"
    )
    by = {r["arm"]: r for r in rows}
    out = [
        head,
        "",
        "| arm | tokens/s | MFU | peak GiB | step s | x hand-compile | x hand-eager | first step s "
        "| loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(
                f"| {r['arm']} | failed: {r['error'][:300].replace('|', '/')} | | | | | | | |"
            )
        elif "tokens_per_s" in r:
            first = "" if r.get("first_step_s") is None else f"{r['first_step_s']:.1f}"
            loss = "" if r.get("loss") is None else f"{r['loss']:.3f}"
            out.append(
                f"| {r['arm']} | {r['tokens_per_s'] / 1e3:.1f}k | {100 * r['mfu']:.1f}% | {r['peak_gib']:.2f} | "
                f"{r['step_s']:.3f} | {ratio(r, by.get('hand-compile'))} | {ratio(r, by.get('hand-eager'))} | "
                f"{first} | {loss} |"
            )
    out += [
        "",
        "Parts of the peak, GiB (params: weights below fp32; master: fp32 weights; activations: peak minus "
        "the four before it, buffers included; resident: allocated between steps)",
        "",
        "| arm | peak | " + " | ".join(PART_KEYS) + " |",
        "|---" * (len(PART_KEYS) + 2) + "|",
    ]
    for r in rows:
        if "parts" in r:
            out.append(
                f"| {r['arm']} | {r['peak_gib']:.2f} | "
                + " | ".join(f"{r['parts'][k] / 2**30:.2f}" for k in PART_KEYS)
                + " |"
            )
    return "\n".join(out)


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument(
        "--warmup", type=int, default=None, help="default: 5 for compiled arms, 3 otherwise"
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=240, help="seconds per arm")
    p.add_argument("--out", default="bench_compile.jsonl")
    p.add_argument(
        "--logs", metavar="DIR", help="each arm's output as DIR/ARM.log (default: OUT.ARM.log)"
    )
    p.add_argument(
        "--plait-fused",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply PLAIT_MODEL_OVERRIDES to the plait arms' model config",
    )
    p.add_argument(
        "--snapshot", metavar="DIR", help="record one step's allocations per arm instead of timing"
    )
    p.add_argument(
        "--report", nargs="+", metavar="JSONL", help="print the tables of earlier runs and exit"
    )
    p.add_argument(
        "--top", metavar="PICKLE", help="print the largest allocations live at a snapshot's peak"
    )
    p.add_argument("--one", help=argparse.SUPPRESS)
    return p.parse_args()


def child_args(args) -> list[str]:
    out = ["--steps", str(args.steps)] + (
        [] if args.warmup is None else ["--warmup", str(args.warmup)]
    )
    out += [] if args.plait_fused else ["--no-plait-fused"]
    return out + ([] if args.snapshot is None else ["--snapshot", args.snapshot])


def main():
    args = parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_arm(args.one, args)), flush=True)
        return
    if args.top:
        from _memory import top_allocations

        print(top_allocations(args.top))
        return
    if args.report:
        rows = [json.loads(line) for path in args.report for line in open(path) if line.strip()]
        print(report(rows))
        return
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {','.join(ARMS)}")
    if os.path.exists(args.out):
        os.remove(args.out)  # this script's --out holds one run
    print("\n" + report(run_arms(__file__, arms, args, child_args(args))))


if __name__ == "__main__":
    main()
