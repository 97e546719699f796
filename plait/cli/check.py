"""``plait check-config``: validate a ds_config JSON and print it resolved."""

from __future__ import annotations

import argparse
import json
import os
import sys

from plait.cli.common import cli_words


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path of a DeepSpeed-style JSON config")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size")
    p.add_argument(
        "--world-size", type=int, default=None, help="total ranks (dp = world / (tp*pp))"
    )
    p.add_argument(
        "--hidden", type=int, default=None, help="model hidden size (resolves bucket 'auto')"
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="value for train_micro_batch_size_per_gpu 'auto'",
    )
    p.add_argument(
        "--grad-accum", type=int, default=None, help="value for gradient_accumulation_steps 'auto'"
    )
    p.add_argument(
        "--precision",
        choices=("fp16", "bf16", "fp32"),
        default=None,
        help="resolves fp16/bf16 enabled 'auto'",
    )
    p.add_argument("--lr", type=float, default=None, help="resolves optimizer lr 'auto'")
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="resolves scheduler warmup_num_steps 'auto'"
    )
    p.add_argument(
        "--total-steps", type=int, default=None, help="resolves scheduler total_num_steps 'auto'"
    )


#: check-config flag -> (attribute, where the file sets it): a flag fills only an "auto" value there.
_FILLS = {
    "--lr": ("lr", [("optimizer", "params", "lr")]),
    "--precision": ("precision", [("bf16", "enabled"), ("fp16", "enabled")]),
    "--warmup-steps": ("warmup_steps", [("scheduler", "params", "warmup_num_steps")]),
    "--total-steps": ("total_steps", [("scheduler", "params", "total_num_steps")]),
    "--micro-batch": ("micro_batch", [("train_micro_batch_size_per_gpu",)]),
    "--grad-accum": ("grad_accum", [("gradient_accumulation_steps",)]),
}
_HIDDEN_KEYS = (
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)


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
            notes.append(
                f'{flag} {value} is not used: the file sets {where} (flags fill only "auto" values; '
                f'write "auto" there to take the flag)'
            )
    return notes


def run(args: argparse.Namespace) -> int:
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
    later = (
        [k for k in _HIDDEN_KEYS if isinstance(zero, dict) and zero.get(k) == "auto"]
        if args.hidden is None
        else []
    )
    notes = _unused_flags(args, raw) if isinstance(raw, dict) else []
    if later:
        notes.append(
            f'zero_optimization {", ".join(later)} stay "auto": plait derives them from the model\'s '
            f"hidden size when it starts (pass --hidden H to see the numbers)"
        )
    triple = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    dp = args.dp
    if (
        dp is None
        and args.world_size is None
        and isinstance(raw, dict)
        and not all(isinstance(raw.get(k), int) for k in triple)
    ):
        dp = 1
        notes.append(
            "train_batch_size = micro-batch x accumulation x data-parallel size: checked at --dp 1; pass "
            "--dp N (or --world-size N) for your launch"
        )
    try:
        cfg = load_config(
            raw,
            dp_size=dp,
            world_size=args.world_size,
            model_hidden_size=args.hidden or (1024 if later else None),
            micro_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.grad_accum,
            mixed_precision=args.precision,
            lr=args.lr,
            warmup_num_steps=args.warmup_steps,
            total_num_steps=args.total_steps,
        )
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
