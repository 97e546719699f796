"""The ``plait`` command line.

Subcommands live in :data:`COMMANDS`: each is a :class:`Command` with a name, a one-line help, a function
that adds its arguments to an ``argparse`` parser, and a function that runs it and returns the exit status.
Heavy modules are imported inside ``run`` so ``plait --help`` stays fast.

    plait estimate-memory CONFIG_JSON|PRESET [--gpu-gib 80] [--micro 4] [--seq 2048] [--act-ckpt] [--ds-config X]
    plait estimate-memory --params 7e9 --dp 8 --stage 3 [--offload-optimizer] [--offload-param]
    plait check-config ds_config.json --dp 8 [--hidden 4096]
    plait convert from-hf HF_DIR ROOT | to-hf ROOT OUT_DIR [--dtype bf16] [--max-shard-size 5GB]
    plait convert consolidate ROOT OUT.safetensors [--model-only] | inspect ROOT [--tag TAG]
    plait convert reshard ROOT NEW_ROOT [--max-file-size 5GB]

Errors name this command's flags (``--hidden``), not the Python arguments behind them (:func:`cli_words`).
"""
from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face config.json (or its folder) or a plait preset: plan this run on one GPU")
    p.add_argument("--params", type=parse_count, default=None, help="parameter count, e.g. 7e9 or 7B (ZeRO table)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (ranks ZeRO partitions over)")
    p.add_argument("--stage", type=int, choices=range(4), default=None,
                   help="ZeRO stage (table: the row to mark; model: default 3)")
    p.add_argument("--offload-optimizer", action="store_true", help="optimizer states on the host (stage>=1)")
    p.add_argument("--offload-param", action="store_true", help="parameters on the host too (stage 3)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per host (default 8)")
    p.add_argument("--fp32", action="store_true", help="pure fp32 training (4+4+8 bytes) instead of mixed")
    p.add_argument("--optimizer-states", type=int, default=2, help="fp32 states per param (Adam 2, Lion 1)")
    p.add_argument("--largest-layer-params", type=parse_count, default=0,
                   help="stage 3: params of the largest layer, gathered whole while it runs (default 0)")
    p.add_argument("--unit", choices=("GiB", "GB"), default="GiB")
    g = p.add_argument_group("planning a model (with MODEL)")
    g.add_argument("--gpu-gib", type=float, default=None, help="GPU memory, GiB (default: this machine's GPU)")
    g.add_argument("--host-gib", type=float, default=None, help="host memory, GiB (default: this machine's)")
    g.add_argument("--micro", type=int, default=1, help="micro-batch per GPU (default 1)")
    g.add_argument("--seq", type=int, default=2048, help="sequence length, tokens (default 2048)")
    g.add_argument("--act-ckpt", action="store_true", help="activation checkpointing of every block")
    g.add_argument("--ratio", type=float, default=1.0,
                   help="offload_optimizer.ratio: share of optimizer states on the host (default 1)")
    g.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="Adam's moments (optimizer.params.state_dtype; default fp32)")
    g.add_argument("--ds-config", default=None, help="read stage, offload and micro-batch from this ds_config")


def _run_estimate(args: argparse.Namespace) -> int:
    from plait.zero.memory import estimate_all_stages, format_memory_table

    if args.model is not None:
        from plait.fit.report import run_plan
        return run_plan(args)
    if args.params is None or args.dp is None:
        print("plait estimate-memory: give a model (config.json or preset) or --params and --dp", file=sys.stderr)
        return 2

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
    p.add_argument("--lr", type=float, default=None, help="resolves optimizer lr 'auto'")
    p.add_argument("--warmup-steps", type=int, default=None, help="resolves scheduler warmup_num_steps 'auto'")
    p.add_argument("--total-steps", type=int, default=None, help="resolves scheduler total_num_steps 'auto'")


#: Python argument names in plait's messages -> the flags of this command line that set them.
FLAGS = {"model_hidden_size": "--hidden", "dp_size": "--dp", "world_size": "--world-size", "lr": "--lr",
         "micro_batch_size": "--micro-batch", "gradient_accumulation_steps": "--grad-accum",
         "mixed_precision": "--precision", "warmup_num_steps": "--warmup-steps", "total_num_steps": "--total-steps",
         "tag": "--tag", "overwrite": "--overwrite"}


def cli_words(message: str) -> str:
    """``message`` with ``pass model_hidden_size=... to plait.initialize (or load_config)`` and the like
    rewritten as ``pass --hidden`` (the flags of :data:`FLAGS`)."""
    message = re.sub(r" to (plait\.initialize|load_config)( \(or load_config\))?", "", message)
    return re.sub(r"\b([a-z_]+)=(\.\.\.|True)?( \(--[a-z-]+\))?",
                  lambda m: FLAGS.get(m.group(1), m.group(0)) if m.group(1) in FLAGS else m.group(0), message)


#: check-config flag -> (attribute, where the file sets it): a flag fills only an "auto" value there.
_FILLS = {"--lr": ("lr", [("optimizer", "params", "lr")]),
          "--precision": ("precision", [("bf16", "enabled"), ("fp16", "enabled")]),
          "--warmup-steps": ("warmup_steps", [("scheduler", "params", "warmup_num_steps")]),
          "--total-steps": ("total_steps", [("scheduler", "params", "total_num_steps")]),
          "--micro-batch": ("micro_batch", [("train_micro_batch_size_per_gpu",)]),
          "--grad-accum": ("grad_accum", [("gradient_accumulation_steps",)])}
_HIDDEN_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def _at(raw: dict, path: tuple):
    for key in path:
        raw = raw.get(key) if isinstance(raw, dict) else None
    return raw


def _unused_flags(args: argparse.Namespace, raw: dict) -> list[str]:
    """A note for each flag given where the file sets the value itself (the flag would be ignored)."""
    notes = []
    for flag, (attr, paths) in _FILLS.items():
        value = getattr(args, attr)
        set_at = [(".".join(p), _at(raw, p)) for p in paths if _at(raw, p) not in (None, "auto")]
        if value is not None and set_at and not any(_at(raw, p) == "auto" for p in paths):
            where = ", ".join(f"{k} = {json.dumps(v)}" for k, v in set_at)
            notes.append(f"{flag} {value} is not used: the file sets {where} (flags fill only \"auto\" values; "
                         f"write \"auto\" there to take the flag)")
    return notes


def _run_check(args: argparse.Namespace) -> int:
    from plait.config import ConfigError, load_config

    if not os.path.isfile(args.config):
        print(f"plait check-config: no such file: {args.config}", file=sys.stderr)
        return 2
    try:
        with open(args.config, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as err:
        print(f"plait check-config: {args.config} is not a JSON file: {err}", file=sys.stderr)
        return 2
    zero = raw.get("zero_optimization", {}) if isinstance(raw, dict) else {}
    later = [k for k in _HIDDEN_KEYS if isinstance(zero, dict) and zero.get(k) == "auto"] if args.hidden is None else []
    notes = _unused_flags(args, raw) if isinstance(raw, dict) else []
    if later:
        notes.append(f"zero_optimization {', '.join(later)} stay \"auto\": plait derives them from the model's "
                     f"hidden size when it starts (pass --hidden H to see the numbers)")
    triple = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    dp = args.dp
    if dp is None and args.world_size is None and isinstance(raw, dict) and \
            not all(isinstance(raw.get(k), int) for k in triple):
        dp = 1
        notes.append("train_batch_size = micro-batch x accumulation x data-parallel size: checked at --dp 1; pass "
                     "--dp N (or --world-size N) for your launch")
    try:
        cfg = load_config(raw, dp_size=dp, world_size=args.world_size,
                          model_hidden_size=args.hidden or (1024 if later else None),
                          micro_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
                          mixed_precision=args.precision, lr=args.lr, warmup_num_steps=args.warmup_steps,
                          total_num_steps=args.total_steps)
    except ConfigError as err:
        print(f"plait check-config: {args.config}: {cli_words(str(err))}", file=sys.stderr)
        return 2
    out = cfg.to_dict()
    for key in later:
        out["zero_optimization"][key] = "auto"
    print(json.dumps(out, indent=2))
    for note in notes:
        print(f"plait check-config: note: {note}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------- convert
def _configure_convert(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = sub.add_parser("from-hf", help="Hugging Face directory (config.json + safetensors) -> plait checkpoint")
    a.add_argument("hf_dir", help="directory with config.json and model.safetensors (or its index)")
    a.add_argument("out_root", help="plait checkpoint root to write")
    a.add_argument("--tag", default="hf", help="checkpoint tag (default hf)")
    a.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16, fp16")
    a.add_argument("--gguf-file", default=None, help="a folder without config.json: its GGUF file to import "
                   "(default: its only one; dequantized to fp32 by transformers, needs the gguf package)")
    a.add_argument("--hf-copy", default=None, help="GGUF input: also keep the dequantized Hugging Face folder here")
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
    e = sub.add_parser("reshard", help="rewrite a checkpoint's files offline: every tensor whole, files of at most "
                       "--max-file-size (no layout needs it: any tp/pp/dp loads any plait checkpoint)")
    e.add_argument("root", help="plait checkpoint root")
    e.add_argument("out_root", help="new checkpoint root (training resumes from it)")
    e.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    e.add_argument("--max-file-size", default=None, help="start a new file past this size, e.g. 5GB (default: one)")
    d = sub.add_parser("inspect", help="list tensors, shapes, dtypes, meta and files of a checkpoint")
    d.add_argument("root", help="plait checkpoint root")
    d.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")


def _run_convert(args: argparse.Namespace) -> int:
    from plait.checkpoint import CheckpointError

    source = args.hf_dir if args.action == "from-hf" else args.root
    if not os.path.isdir(source):
        what = "Hugging Face model folder" if args.action == "from-hf" else "checkpoint root"
        print(f"plait convert {args.action}: no such {what}: {source}", file=sys.stderr)
        return 2
    try:
        _CONVERT[args.action](args)
    except BrokenPipeError:
        raise                    # not a checkpoint error: main() ends quietly
    except (CheckpointError, ValueError, OSError) as err:
        print(f"plait convert {args.action}: {cli_words(str(err))}", file=sys.stderr)
        return 2
    return 0


def _from_hf(args: argparse.Namespace) -> None:
    from plait.checkpoint import convert, hf_gguf

    gguf = args.gguf_file or hf_gguf.gguf_file(args.hf_dir)
    if gguf:
        r = hf_gguf.from_gguf(args.hf_dir, args.out_root, gguf, tag=args.tag, dtype=args.dtype, hf_copy=args.hf_copy)
    else:
        r = convert.from_hf(args.hf_dir, args.out_root, tag=args.tag, dtype=args.dtype)
    print(f"wrote {r.path}: {r.tensors} tensors from {r.architecture}" + (f" ({gguf}, dequantized)" if gguf else ""))
    for what, names in (("missing (plait keeps its init)", r.missing), ("kept as hf_extra", r.extra)):
        if names:
            print(f"  {what}: {', '.join(names)}")


def _to_hf(args: argparse.Namespace) -> None:
    from plait.checkpoint import convert

    r = convert.to_hf(args.root, args.out_dir, tag=args.tag, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                      overwrite=args.overwrite, tokenizer_from=args.tokenizer_from, hf_config=args.hf_config)
    print(f"wrote {r.architecture} to {r.out_dir}: {', '.join(r.files)}")
    for what, names in (("missing", r.missing), ("not exported", r.dropped)):
        if names:
            print(f"  {what}: {', '.join(names)}")


def _reshard(args: argparse.Namespace) -> None:
    from plait.checkpoint.hf_export import parse_size
    from plait.checkpoint.reshard import reshard

    r = reshard(args.root, args.out_root, tag=args.tag, max_file_bytes=parse_size(args.max_file_size))
    print(f"wrote {r.path}: {r.tensors} tensors whole (were {r.slices_before} slices) in {len(r.files)} file(s)"
          + ("" if r.rng_kept else "; per-rank RNG states not carried (a resumed run reseeds, as after a layout "
             "change)"))


def _consolidate(args: argparse.Namespace) -> None:
    from plait.checkpoint import convert

    print("wrote " + convert.consolidate(args.root, args.out_file, tag=args.tag, dtype=args.dtype,
                                         model_only=args.model_only))


def _inspect(args: argparse.Namespace) -> None:
    from plait.checkpoint import convert

    convert.inspect(args.root, tag=args.tag)


_CONVERT = {"from-hf": _from_hf, "to-hf": _to_hf, "consolidate": _consolidate, "inspect": _inspect,
            "reshard": _reshard}


#: The subcommand table; append a Command to add one.
COMMANDS: tuple[Command, ...] = (
    Command("estimate-memory", "per-GPU and per-host model-state memory for ZeRO stages 0-3",
            _configure_estimate, _run_estimate),
    Command("check-config", "validate a ds_config JSON and print it resolved", _configure_check, _run_check),
    Command("convert", "checkpoints: from-hf, to-hf, consolidate, inspect, reshard", _configure_convert,
            _run_convert),
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
    try:
        return args._run(args)
    except BrokenPipeError:   # the reader left (``plait convert inspect ROOT | head``): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())    # so the interpreter's final flush does not fail again
        return 141                               # 128 + SIGPIPE, as other tools end in a closed pipe


if __name__ == "__main__":
    sys.exit(main())
