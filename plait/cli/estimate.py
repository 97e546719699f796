"""``plait estimate-memory``: the ZeRO model-state table (``--params``) or the plan of one model
(``plait.fit.report``)."""

from __future__ import annotations

import argparse
import sys

from plait.cli.common import parse_count


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hugging Face config.json (or its folder) or a plait preset: plan this run on one GPU",
    )
    p.add_argument(
        "--params",
        type=parse_count,
        default=None,
        help="parameter count, e.g. 7e9 or 7B (ZeRO table)",
    )
    p.add_argument(
        "--dp", type=int, default=None, help="data-parallel size (ranks ZeRO partitions over)"
    )
    p.add_argument(
        "--stage",
        type=int,
        choices=range(4),
        default=None,
        help="ZeRO stage (table: the row to mark; model: default 3)",
    )
    p.add_argument(
        "--offload-optimizer", action="store_true", help="optimizer states on the host (stage>=1)"
    )
    p.add_argument(
        "--offload-param", action="store_true", help="parameters on the host too (stage 3)"
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per host (default 8)")
    p.add_argument(
        "--fp32", action="store_true", help="pure fp32 training (4+4+8 bytes) instead of mixed"
    )
    p.add_argument(
        "--optimizer-states", type=int, default=2, help="fp32 states per param (Adam 2, Lion 1)"
    )
    p.add_argument(
        "--largest-layer-params",
        type=parse_count,
        default=0,
        help="stage 3: params of the largest layer, gathered whole while it runs (default 0)",
    )
    p.add_argument("--unit", choices=("GiB", "GB"), default="GiB")
    _configure_model(p.add_argument_group("planning a model (with MODEL)"))


def _configure_model(g) -> None:
    """The flags of planning one model (``plait.fit``): the machine, the batch and the placement."""
    g.add_argument(
        "--gpu-gib", type=float, default=None, help="GPU memory, GiB (default: this machine's GPU)"
    )
    g.add_argument(
        "--host-gib", type=float, default=None, help="host memory, GiB (default: this machine's)"
    )
    g.add_argument("--micro", type=int, default=1, help="micro-batch per GPU (default 1)")
    g.add_argument("--seq", type=int, default=2048, help="sequence length, tokens (default 2048)")
    g.add_argument(
        "--act-ckpt", action="store_true", help="activation checkpointing of every block"
    )
    g.add_argument(
        "--ratio",
        type=parse_ratio,
        default=1.0,
        help="offload_optimizer.ratio: share of optimizer states on the host, or auto: the smallest "
        "share whose plan fits the GPU, as the engine picks it (default 1)",
    )
    g.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="Adam's moments (optimizer.params.state_dtype; default fp32)",
    )
    g.add_argument(
        "--model-build",
        choices=("none", "fp32"),
        default="none",
        help="how the model is built: none (plait.hf.from_pretrained or on the GPU: no host copy) or "
        "fp32 (from its config on the host, e.g. LlamaForCausalLM(config): an fp32 copy until "
        "plait.initialize moves it; default none)",
    )
    g.add_argument(
        "--ds-config", default=None, help="read stage, offload and micro-batch from this ds_config"
    )


def parse_ratio(text: str) -> float | str:
    """``--ratio``: a host share in [0, 1], or "auto"."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a host share: give a number in [0, 1] or auto"
        )
    return value


def run(args: argparse.Namespace) -> int:
    from plait.zero.memory import estimate_all_stages, format_memory_table

    if args.model is not None:
        from plait.fit.report import run_plan

        return run_plan(args)
    if args.params is None or args.dp is None:
        print(
            "plait estimate-memory: give a model (config.json or preset) or --params and --dp",
            file=sys.stderr,
        )
        return 2

    rows = estimate_all_stages(
        args.params,
        args.dp,
        args.offload_optimizer,
        args.offload_param,
        mixed_precision=not args.fp32,
        num_gpus_per_node=args.gpus_per_node,
        optimizer_states=args.optimizer_states,
        largest_layer_params=args.largest_layer_params,
    )
    precision = "fp32" if args.fp32 else "mixed precision"
    print(
        f"Model states for {args.params:,} parameters, dp={args.dp}, {precision}, "
        f"{args.gpus_per_node} GPUs per node (ZeRO, Rajbhandari et al. SC'20):"
    )
    table = format_memory_table(rows, unit=args.unit).splitlines()
    if args.stage is not None:
        row = 2 + args.stage
        table[row] = table[row] + "   <- --stage"
    print("\n".join(table))
    return 0
