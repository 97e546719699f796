"""The example scripts' parallel layout and ds_config: the command-line flags (tp, pp, cp, ZeRO, batch sizes,
precision, ...), the config file they override, and the process group, mesh and resolved config they give.

Nothing here keeps module-level state; every helper takes what it needs as arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from plait.config import load_config
from plait.parallel import SCHEDULES, ParallelMesh, init_distributed

EXAMPLES = Path(__file__).resolve().parent


# ---- command line -----------------------------------------------------------------------------------
def add_parallel_args(parser: argparse.ArgumentParser, default_config: str) -> None:
    """Layout, ds_config and loop flags shared by the example scripts."""
    g = parser.add_argument_group("layout and ds_config (command-line values override the JSON)")
    g.add_argument(
        "--config",
        "--deepspeed_config",
        "--deepspeed-config",
        dest="config",
        default=str(EXAMPLES / "configs" / default_config),
        help="DeepSpeed-style JSON (default: %(default)s)",
    )
    g.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel size (default: config, else 2 when the world size is even)",
    )
    g.add_argument(
        "--pp",
        type=int,
        help="pipeline-parallel size (default: config, else 2 when the world "
        "size is a multiple of 4)",
    )
    g.add_argument(
        "--cp",
        type=int,
        help="context-parallel size: each sequence split over this many ranks "
        "(default: the config's context_parallel.size, else 1)",
    )
    g.add_argument(
        "--cp-method",
        choices=["ring", "all_to_all"],
        help="context-parallel attention (default ring)",
    )
    g.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size: a mixture of experts' experts split "
        "over this many dp ranks (default 1)",
    )
    g.add_argument("--schedule", choices=list(SCHEDULES), help="pipeline schedule")
    g.add_argument(
        "--virtual-stages", type=int, help="model chunks per pipeline rank (interleaved; zb-v: 2)"
    )
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay each pipeline action as a CUDA graph (pipeline.cuda_graphs; pp > 1, tp 1, ZeRO <= 2)",
    )
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    g.add_argument(
        "--offload",
        choices=["none", "optimizer", "param", "all"],
        help="ZeRO-Offload of optimizer states and/or parameters to the CPU",
    )
    g.add_argument("--micro-batch", type=int, help="samples per rank per micro-step")
    g.add_argument("--global-batch", type=int, help="samples per optimizer step over all dp ranks")
    g.add_argument(
        "--grad-accum", type=int, help="gradient accumulation steps (pipeline micro-batches)"
    )
    g.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16", "fp16"],
        default="auto",
        help="auto: bf16 on GPUs that have it, fp32 on CPU",
    )
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup", type=int, help="warmup steps (default: 10%% of --steps)")
    g.add_argument("--clip", type=float, help="gradient clipping (max global norm)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--recompute", action="store_true", help="recompute each block's activations in backward"
    )
    g.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.compile each transformer block (auto: the config's compile section, else on for "
        "CUDA and off on CPU)",
    )

    r = parser.add_argument_group("run")
    r.add_argument("--steps", type=int, default=300, help="optimizer steps in the whole run")
    r.add_argument("--log-every", type=int, default=10)
    r.add_argument("--eval-every", type=int, default=50)
    r.add_argument("--eval-batches", type=int, default=4, help="eval_batch calls per validation")
    r.add_argument("--save-every", type=int, default=100)
    r.add_argument("--keep-last", type=int, default=2, help="checkpoints kept on disk")
    r.add_argument(
        "--out-dir",
        default="runs/" + Path(sys.argv[0]).stem,
        help="checkpoints/, metrics.jsonl and the exports go here (default: %(default)s)",
    )
    r.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default="auto",
        help="auto (default): continue from <out-dir>/checkpoints/latest when it exists "
        "(what torchrun --max-restarts needs); --resume alone: require it; never: start over; "
        "or a checkpoint tag",
    )
    r.add_argument(
        "--stop-at-step", type=int, help="stop (after saving) at this step, as if interrupted"
    )
    r.add_argument(
        "--timeout",
        type=float,
        help="collective timeout in seconds for the whole run (default: the "
        "config's comm timeouts, 600 s until the first step, then 180 s)",
    )
    r.add_argument(
        "--gc-interval",
        type=int,
        help="full Python garbage collection every N optimizer steps, "
        "automatic collection off (default: the config's garbage_collection, else 50; 0: Python's own)",
    )
    r.add_argument(
        "--peak-tflops", type=float, help="per-device peak for MFU (default: H100/H200 bf16)"
    )
    r.add_argument(
        "--crash-at-step", type=int, help=argparse.SUPPRESS
    )  # tests: SIGKILL global rank 1


def choose_layout(args, raw: dict, world: int) -> tuple[int, int, int]:
    """(tp, pp, cp): command line, else the config's sections, else tp x pp 2 x 2 / 2 x 1 / 1 x 1 by the
    world size left after cp (cp default 1)."""
    cp = getattr(args, "cp", None) or raw.get("context_parallel", {}).get("size") or 1
    tp = args.tp or raw.get("tensor_parallel", {}).get("size")
    pp = args.pp or raw.get("pipeline", {}).get("size") or raw.get("pipeline", {}).get("stages")
    rest = world // cp if world % cp == 0 else world
    if tp is None and pp is None:
        tp, pp = (2, 2) if rest % 4 == 0 else (2, 1) if rest % 2 == 0 else (1, 1)
    elif tp is None:
        tp = 2 if rest % (2 * pp) == 0 else 1
    elif pp is None:
        pp = 2 if rest % (2 * tp) == 0 else 1
    if world % (tp * pp * cp):
        raise SystemExit(
            f"world size {world} is not divisible by tp x pp x cp = {tp} x {pp} x {cp}; launch a "
            f"multiple of {tp * pp * cp} processes (torchrun --nproc-per-node) or change --tp/--pp/--cp"
        )
    return tp, pp, cp


def apply_zero_flags(cfg: dict, args) -> None:
    """``--zero-stage`` and ``--offload {none,optimizer,param,all}`` into a ds_config dict, in place."""
    zero = cfg.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    if args.offload is not None:
        zero["offload_optimizer"] = {
            "device": "cpu" if args.offload in ("optimizer", "all") else "none"
        }
        zero["offload_param"] = {"device": "cpu" if args.offload in ("param", "all") else "none"}


def build_ds_config(args, raw: dict, tp: int, pp: int, cp: int = 1) -> dict:
    """The ds_config dict after command-line overrides (the JSON file itself is not changed)."""
    cfg = json.loads(json.dumps(raw))
    cfg.setdefault("tensor_parallel", {})["size"] = tp
    cfg.setdefault("context_parallel", {})["size"] = cp
    if getattr(args, "cp_method", None):
        cfg["context_parallel"]["method"] = args.cp_method
    pipe = cfg.setdefault("pipeline", {})
    pipe.pop("stages", None)
    pipe["size"] = pp
    if args.sequence_parallel is not None:
        cfg["tensor_parallel"]["sequence_parallel"] = args.sequence_parallel and tp > 1
    if args.schedule:
        pipe["schedule"] = args.schedule
    if args.virtual_stages:
        pipe["virtual_stages"] = args.virtual_stages
    if getattr(args, "cuda_graphs", None) is not None:
        pipe["cuda_graphs"] = args.cuda_graphs
    if pipe.get("schedule") == "interleaved" and pipe.get("virtual_stages", 1) < 2:
        pipe["virtual_stages"] = 2
    if pipe.get("schedule") == "zb-v":
        pipe["virtual_stages"] = 2  # the V placement: two chunks per rank
    triple = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    given = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
    }
    for key, value in given.items():
        if value is not None:
            cfg[key] = value
    if all(k in cfg for k in triple) and given["gradient_accumulation_steps"] is None:
        cfg.pop("gradient_accumulation_steps")  # keep the global batch, derive accumulation
    elif all(k in cfg for k in triple) and given["train_batch_size"] is None:
        cfg.pop("train_batch_size")
    apply_zero_flags(cfg, args)
    if args.clip is not None:
        cfg["gradient_clipping"] = args.clip
    if args.lr is not None:
        cfg.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
        sched = cfg.get("scheduler", {}).get("params", {})
        if "warmup_max_lr" in sched:
            sched["warmup_max_lr"] = args.lr
    cfg.setdefault("seed", args.seed)
    cfg["steps_per_print"] = (
        0  # the script prints its own line every --log-every steps: not a second one
    )
    gc_interval = getattr(args, "gc_interval", None)
    if gc_interval is not None:
        cfg["garbage_collection"] = {"interval": gc_interval}
    cfg.setdefault("garbage_collection", {"interval": 50})  # torchtitan's gc_freq
    return cfg


def precision_for(args, device: torch.device) -> str:
    if args.precision != "auto":
        return args.precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def setup(args, model_hidden: int):
    """Start the process group and build the mesh and resolved config.

    Returns ``(info, mesh, plait_config, ds_dict)``; ``ds_dict`` is what the config file plus flags said."""
    info = init_distributed(timeout_s=args.timeout)
    with open(args.config, encoding="utf-8") as f:
        raw = json.load(f)
    tp, pp, cp = choose_layout(args, raw, info.world_size)
    mesh = ParallelMesh(tp=tp, pp=pp, cp=cp, ep=args.ep)
    ds = build_ds_config(args, raw, tp, pp, cp)
    if args.compile != "auto" or "compile" not in ds:
        ds["compile"] = {
            "enabled": args.compile == "on" or args.compile == "auto" and mesh.device.type == "cuda"
        }
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    cfg = load_config(
        ds,
        dp_size=mesh.dp,
        model_hidden_size=model_hidden,
        lr=args.lr,
        mixed_precision=precision_for(args, mesh.device),
        warmup_num_steps=warmup,
        total_num_steps=args.steps,
    )
    return info, mesh, cfg, ds


def zero_desc(cfg) -> str:
    """ "ZeRO-3 + offload optimizer, param" style summary of the config's ZeRO section."""
    z = cfg.zero_optimization
    off = [
        name
        for name, o in (("optimizer", z.offload_optimizer), ("param", z.offload_param))
        if o.enabled
    ]
    return f"ZeRO-{z.stage}" + (f" + offload {', '.join(off)}" if off else "")
