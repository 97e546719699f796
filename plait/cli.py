"""The ``plait`` command line.

Subcommands live in :data:`COMMANDS`: each is a :class:`Command` with a name, a one-line help, a function
that adds its arguments to an ``argparse`` parser, and a function that runs it and returns the exit status.
Adding a subcommand (e.g. ``convert``) means writing those two functions and one table entry; import heavy
modules inside ``run`` so ``plait --help`` stays fast.

    plait estimate-memory --params 7e9 --dp 8 --stage 3 [--offload-optimizer] [--offload-param]
    plait check-config ds_config.json --dp 8 [--hidden 4096]
    plait convert from-hf HF_DIR ROOT | to-hf ROOT OUT_DIR [--dtype bf16] [--max-shard-size 5GB]
    plait convert consolidate ROOT OUT.safetensors [--model-only] | inspect ROOT [--tag TAG]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from collections.abc import Callable, Sequence


@dataclass(frozen=True)
class Command:
    """One subcommand: ``configure(parser)`` adds arguments; ``run(args) -> exit status``."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """Parse a parameter count: "7e9", "7000000000", "7B", "1.3b", "350M", "70k" -> int."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 7e9 or 7B)")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"parameter count must be a whole non-negative number, got {text!r}")
    return int(value)


# -------------------------------------------------------------------------------------- estimate-memory
def _configure_estimate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=parse_count, required=True, help="parameter count, e.g. 7e9 or 7B")
    p.add_argument("--dp", type=int, required=True, help="data-parallel size (ranks ZeRO partitions over)")
    p.add_argument("--stage", type=int, choices=range(4), default=None,
                   help="ZeRO stage to mark in the table (all stages 0-3 are printed)")
    p.add_argument("--offload-optimizer", action="store_true", help="optimizer states on the host (stage>=1)")
    p.add_argument("--offload-param", action="store_true", help="parameters on the host too (stage 3)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per host (default 8)")
    p.add_argument("--fp32", action="store_true", help="pure fp32 training (4+4+8 bytes) instead of mixed")
    p.add_argument("--optimizer-states", type=int, default=2, help="fp32 states per param (Adam 2, Lion 1)")
    p.add_argument("--largest-layer-params", type=parse_count, default=0,
                   help="stage 3: params of the largest layer, gathered whole while it runs (default 0)")
    p.add_argument("--unit", choices=("GiB", "GB"), default="GiB")


def _run_estimate(args: argparse.Namespace) -> int:
    from plait.zero.memory import estimate_all_stages, format_memory_table

    rows = estimate_all_stages(args.params, args.dp, args.offload_optimizer, args.offload_param,
                               mixed_precision=not args.fp32, num_gpus_per_node=args.gpus_per_node,
                               optimizer_states=args.optimizer_states,
                               largest_layer_params=args.largest_layer_params)
    precision = "fp32" if args.fp32 else "mixed precision"
    print(f"Model states for {args.params:,} parameters, dp={args.dp}, {precision}, "
          f"{args.gpus_per_node} GPUs per node (ZeRO, Rajbhandari et al. SC'20):")
    table = format_memory_table(rows, unit=args.unit).splitlines()
    if args.stage is not None:
        row = 2 + args.stage
        table[row] = table[row] + "   <- --stage"
    print("\n".join(table))
    return 0


# ----------------------------------------------------------------------------------------- check-config
def _configure_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path of a DeepSpeed-style JSON config")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size")
    p.add_argument("--world-size", type=int, default=None, help="total ranks (dp = world / (tp*pp))")
    p.add_argument("--hidden", type=int, default=None, help="model hidden size (resolves bucket 'auto')")
    p.add_argument("--micro-batch", type=int, default=None, help="value for train_micro_batch_size_per_gpu 'auto'")
    p.add_argument("--grad-accum", type=int, default=None, help="value for gradient_accumulation_steps 'auto'")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default=None,
                   help="resolves fp16/bf16 enabled 'auto'")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--total-steps", type=int, default=None)


def _run_check(args: argparse.Namespace) -> int:
    from plait.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, dp_size=args.dp, world_size=args.world_size, model_hidden_size=args.hidden,
                          micro_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
                          mixed_precision=args.precision, lr=args.lr, warmup_num_steps=args.warmup_steps,
                          total_num_steps=args.total_steps)
    except (ConfigError, OSError) as err:
        print(f"plait check-config: {err}", file=sys.stderr)
        return 2
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


# ----------------------------------------------------------------------------------------------- convert
def _configure_convert(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = sub.add_parser("from-hf", help="Hugging Face directory (config.json + safetensors) -> plait checkpoint")
    a.add_argument("hf_dir", help="directory with config.json and model.safetensors (or its index)")
    a.add_argument("out_root", help="plait checkpoint root to write")
    a.add_argument("--tag", default="hf", help="checkpoint tag (default hf)")
    a.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16, fp16")
    b = sub.add_parser("to-hf", help="plait checkpoint (any layout) -> Hugging Face directory")
    b.add_argument("root", help="plait checkpoint root")
    b.add_argument("out_dir", help="output directory (config.json + model*.safetensors)")
    b.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    b.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16, fp16")
    b.add_argument("--max-shard-size", default=None, help="split weights into shards, e.g. 5GB or 500MiB")
    b.add_argument("--overwrite", action="store_true", help="replace weights already in out_dir")
    b.add_argument("--tokenizer-from", default=None,
                   help="copy the tokenizer, chat template and generation files from this directory")
    b.add_argument("--hf-config", default=None, help="the trained transformers model's original config.json "
                   "(for checkpoints saved without it, e.g. by older plait versions)")
    c = sub.add_parser("consolidate", help="every logical tensor whole in one safetensors file")
    c.add_argument("root", help="plait checkpoint root")
    c.add_argument("out_file", help="output .safetensors file")
    c.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    c.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16, fp16")
    c.add_argument("--model-only", action="store_true", help="leave out optimizer state and hf_extra tensors")
    d = sub.add_parser("inspect", help="list tensors, shapes, dtypes, meta and files of a checkpoint")
    d.add_argument("root", help="plait checkpoint root")
    d.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")


def _run_convert(args: argparse.Namespace) -> int:
    from plait.checkpoint import CheckpointError, convert

    try:
        if args.action == "from-hf":
            r = convert.from_hf(args.hf_dir, args.out_root, tag=args.tag, dtype=args.dtype)
            print(f"wrote {r.path}: {r.tensors} tensors from {r.architecture}")
            for what, names in (("missing (plait keeps its init)", r.missing), ("kept as hf_extra", r.extra)):
                if names:
                    print(f"  {what}: {', '.join(names)}")
        elif args.action == "to-hf":
            r = convert.to_hf(args.root, args.out_dir, tag=args.tag, dtype=args.dtype,
                              max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                              tokenizer_from=args.tokenizer_from, hf_config=args.hf_config)
            print(f"wrote {r.architecture} to {r.out_dir}: {', '.join(r.files)}")
            for what, names in (("missing", r.missing), ("not exported", r.dropped)):
                if names:
                    print(f"  {what}: {', '.join(names)}")
        elif args.action == "consolidate":
            print("wrote " + convert.consolidate(args.root, args.out_file, tag=args.tag, dtype=args.dtype,
                                                 model_only=args.model_only))
        else:
            convert.inspect(args.root, tag=args.tag)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"plait convert {args.action}: {err}", file=sys.stderr)
        return 2
    return 0


#: The subcommand table; append a Command to add one.
COMMANDS: tuple[Command, ...] = (
    Command("estimate-memory", "per-GPU and per-host model-state memory for ZeRO stages 0-3",
            _configure_estimate, _run_estimate),
    Command("check-config", "validate a ds_config JSON and print it resolved", _configure_check, _run_check),
    Command("convert", "checkpoints: from-hf, to-hf, consolidate, inspect", _configure_convert, _run_convert),
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command."""
    parser = argparse.ArgumentParser(prog="plait", description="plait: tensor, pipeline and ZeRO data "
                                     "parallel training tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` script; returns the exit status (also usable from Python)."""
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
