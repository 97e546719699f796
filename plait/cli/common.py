"""What the subcommands of :mod:`plait.cli` share: the :class:`Command` record, :func:`parse_count`, and
:func:`cli_words`, which names this command line's flags in plait's messages."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass


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
        raise argparse.ArgumentTypeError(
            f"parameter count must be a whole non-negative number, got {text!r}"
        )
    return int(value)


#: Python argument names in plait's messages -> the flags of this command line that set them.
FLAGS = {
    "model_hidden_size": "--hidden",
    "dp_size": "--dp",
    "world_size": "--world-size",
    "lr": "--lr",
    "micro_batch_size": "--micro-batch",
    "gradient_accumulation_steps": "--grad-accum",
    "mixed_precision": "--precision",
    "warmup_num_steps": "--warmup-steps",
    "total_num_steps": "--total-steps",
    "tag": "--tag",
    "overwrite": "--overwrite",
}


def cli_words(message: str) -> str:
    """``message`` with ``pass model_hidden_size=... to plait.initialize (or load_config)`` and the like
    rewritten as ``pass --hidden`` (the flags of :data:`FLAGS`)."""
    message = re.sub(r" to (plait\.initialize|load_config)( \(or load_config\))?", "", message)
    return re.sub(
        r"\b([a-z_]+)=(\.\.\.|True)?( \(--[a-z-]+\))?",
        lambda m: FLAGS.get(m.group(1), m.group(0)) if m.group(1) in FLAGS else m.group(0),
        message,
    )
