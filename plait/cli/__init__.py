"""The ``plait`` command line.

Subcommands live in :data:`COMMANDS`: each is a :class:`Command` with a name, a one-line help, a function
that adds its arguments to an ``argparse`` parser, and a function that runs it and returns the exit status;
one module per subcommand (``plait.cli.estimate``, ``plait.cli.check``, ``plait.cli.convert``).
Heavy modules are imported inside ``run`` so ``plait --help`` stays fast.

    plait estimate-memory CONFIG_JSON|PRESET [--gpu-gib 80] [--micro 4] [--seq 2048] [--act-ckpt] [--ds-config X]
        [--ratio 0.5|auto] [--state-dtype int8] [--model-build fp32]
    plait estimate-memory --params 7e9 --dp 8 --stage 3 [--offload-optimizer] [--offload-param]
    plait check-config ds_config.json --dp 8 [--hidden 4096]
    plait convert from-hf HF_DIR ROOT | to-hf ROOT OUT_DIR [--dtype bf16] [--max-shard-size 5GB]
    plait convert consolidate ROOT OUT.safetensors [--model-only] | inspect ROOT [--tag TAG]
    plait convert reshard ROOT NEW_ROOT [--max-file-size 5GB]

Errors name this command's flags (``--hidden``), not the Python arguments behind them (:func:`cli_words`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from plait.cli import check, convert, estimate
from plait.cli.common import FLAGS, Command, cli_words, parse_count

__all__ = ["COMMANDS", "FLAGS", "Command", "build_parser", "cli_words", "main", "parse_count"]


#: The subcommand table; append a Command to add one.
COMMANDS: tuple[Command, ...] = (
    Command(
        "estimate-memory",
        "per-GPU and per-host model-state memory for ZeRO stages 0-3",
        estimate.configure,
        estimate.run,
    ),
    Command(
        "check-config",
        "validate a ds_config JSON and print it resolved",
        check.configure,
        check.run,
    ),
    Command(
        "convert",
        "checkpoints: from-hf, to-hf, consolidate, inspect, reshard",
        convert.configure,
        convert.run,
    ),
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="plait", description="plait: tensor, pipeline and ZeRO data parallel training tools"
    )
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
    except BrokenPipeError:  # the reader left (``plait convert inspect ROOT | head``): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(
            devnull, sys.stdout.fileno()
        )  # so the interpreter's final flush does not fail again
        return 141  # 128 + SIGPIPE, as other tools end in a closed pipe


if __name__ == "__main__":
    sys.exit(main())
