"""``python -m plait.accelerate.launch``: ``accelerate launch`` for DeepSpeed runs on plait (accelerate's own
stops with ``ImportError: DeepSpeed is not installed``).

Takes ``accelerate launch``'s arguments and config file, checks them and builds the environment with
accelerate's own code (``prepare_deepspeed_cmd_env``), and starts the processes with
``torch.distributed.run``; ``plait.accelerate.Accelerator`` reads that environment::

    python -m plait.accelerate.launch --use_deepspeed --deepspeed_config_file ds_config.json \\
        --num_processes 8 train.py --lr 1e-4

Refused (naming the flag): runs without ``--use_deepspeed``, and ``--deepspeed_multinode_launcher`` other
than ``standard``. More: ``docs/accelerate.md``.
"""

from __future__ import annotations

import sys

from accelerate.commands import launch as accelerate_launch
from accelerate.utils import patch_environment
from accelerate.utils.constants import DEEPSPEED_MULTINODE_LAUNCHERS
from accelerate.utils.launch import prepare_deepspeed_cmd_env


def main(argv: list[str] | None = None) -> None:
    """Parse ``accelerate launch``'s arguments and start the DeepSpeed run on plait (module docstring).

    Raises:
        SystemExit: no ``--use_deepspeed`` (neither flag nor config file), or a DeepSpeed multi-node launcher.
    """
    args = accelerate_launch.launch_command_parser().parse_args(argv)
    args, defaults, mp_from_config_flag = accelerate_launch._validate_launch_command(args)
    if not args.use_deepspeed:
        raise SystemExit(
            "plait.accelerate.launch starts DeepSpeed runs (--use_deepspeed, or use_deepspeed in the "
            "accelerate config file); launch other runs with accelerate launch"
        )
    if args.num_machines > 1 and args.deepspeed_multinode_launcher not in (
        None,
        DEEPSPEED_MULTINODE_LAUNCHERS[1],
    ):
        raise SystemExit(
            f"--deepspeed_multinode_launcher {args.deepspeed_multinode_launcher} needs DeepSpeed's "
            "launcher; start each machine with --deepspeed_multinode_launcher standard"
        )
    # as accelerate's launch_command before its DeepSpeed launcher
    fields = list(defaults.deepspeed_config.keys()) if defaults else []
    if mp_from_config_flag:
        fields.append("mixed_precision")
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    import torch.distributed.run as distrib_run

    torchrun_args = accelerate_launch._filter_args(
        args,
        distrib_run.get_args_parser(),
        [
            "--training_script",
            args.training_script,
            "--training_script_args",
            args.training_script_args,
        ],
    )
    with patch_environment(**env):
        distrib_run.run(torchrun_args)


if __name__ == "__main__":
    main(sys.argv[1:])
