"""bench_float8's torchtitan arms (titan-bf16, titan-fp8-rowwise, titan-fp8-tensorwise): torchtitan's own
``Trainer`` (``_titan.make_titan``) at bench_float8's Llama shape, float8 turned on as torchtitan's users turn it
on: its ``Float8LinearConverter`` applied to the model config with the recipe's name, the output head
(``lm_head``) left in bf16 as in the other arms. Activation checkpointing is torchtitan's ``FullAC`` (every
block: ``--recompute`` all) or none (``--recompute 0``); torchtitan has no first-N-blocks mode.

torchtitan 0.3.0 offers the float8 recipes "rowwise" and "rowwise_with_gw_hp" only: titan-fp8-tensorwise is
refused by ``_titan.float8_converter`` with the recipes it offers (tensorwise with its float8 FSDP all-gather
and precomputed scales was torchtitan 0.2's), and fsdp2-fp8-tensorwise stays the tensorwise peer.

torchtitan's Trainer needs CUDA (it sets the CUDA device when built). Under ``--dry-run`` (CPU) an arm checks
what comes before that: the Trainer's config (with its own checks), the converter, and the model built from
the converted config on the meta device, counting its float8 linears; the row says it was not run.
"""

from __future__ import annotations

import os

import torch


def titan_module():
    """``_titan``, or ImportError naming what this torch lacks and what the arm needs."""
    try:
        import _titan
    except ImportError as e:
        raise ImportError(
            f"torchtitan is not importable with torch {torch.__version__} ({e}): install torchtitan "
            "0.3.0, spmd_types 0.2.3, tyro, docstring_parser, typeguard, torchdata, torch_checkpointing "
            "(pip install --no-deps; on the GPU: carry .whl-titan/)"
        ) from e
    return _titan


def titan_setup(arm: str, cfg, recipe: str | None, args) -> dict:
    """``make_titan``'s keywords for ``arm`` (besides micro, seq, steps, CUDA graphs)."""
    _titan = titan_module()
    if args.recompute == 0:
        ac = None
    elif args.recompute >= cfg.num_layers:
        ac = "full"
    else:
        raise ValueError(
            f"{arm}: torchtitan checkpoints every block or none, not the first {args.recompute} of "
            f"{cfg.num_layers}: pass --recompute 0 or --recompute {cfg.num_layers} (or more)"
        )
    converters = ()
    if recipe:
        converter = _titan.float8_converter(
            recipe, compile_on=not args.dry_run, emulate=args.dry_run, skip=("lm_head",)
        )
        converters = (converter,)
    return {
        "compile_on": not args.dry_run,
        "gas": args.gas,
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "converters": converters,
        "activation_checkpoint": ac,
        "flavor": args.preset,
    }


def count_linears(model: torch.nn.Module) -> tuple[int, int]:
    """(torchao ``Float8Linear`` modules, all ``nn.Linear`` modules, those included) in ``model``."""
    from torchao.float8.float8_linear import Float8Linear

    modules = list(model.modules())
    return (
        sum(isinstance(m, Float8Linear) for m in modules),
        sum(isinstance(m, torch.nn.Linear) for m in modules),
    )


def checked_counts(arm: str, model, recipe: str | None) -> dict:
    """The row's float8 fields; RuntimeError when a float8 arm converted no linear (torchtitan's converter
    only warns and stays bf16 with a torchao that lacks recipe lookup) or a bf16 arm converted some."""
    f8, linears = count_linears(model)
    if recipe and f8 == 0:
        raise RuntimeError(
            f"{arm}: torchtitan converted none of the model's {linears} linears to float8: "
            "this is no float8 measurement (does this GPU have float8, SM 8.9 or later?)"
        )
    if not recipe and f8:
        raise RuntimeError(f"{arm}: a bf16 arm has {f8} Float8Linear modules")
    return {"float8_linears": f8, "linears": linears}


def titan_arm(arm: str, cfg, recipe: str | None, args):
    """``(step(i) -> loss or None, row fields)``: the step returns torchtitan's logged loss at the last
    step of warm-up plus timed steps, None before it."""
    from _common import single_process_env

    _titan = titan_module()
    setup = titan_setup(arm, cfg, recipe, args)
    single_process_env()
    cuda_graphs = not args.titan_no_cuda_graphs
    steps = args.warmup + args.steps + 1  # make_titan's step `steps - 1` returns the logged loss
    run = _titan.make_titan(
        cfg, micro=args.micro, seq=args.seq, steps=steps, cuda_graphs=cuda_graphs, **setup
    )
    expected = cfg.num_parameters()
    if run.n_params != expected:
        raise RuntimeError(
            f"torchtitan's model has {run.n_params:,} parameters, plait's {expected:,}"
        )
    row = checked_counts(arm, run.model, recipe)
    print(f"{arm}: {row['float8_linears']} Float8Linear of {row['linears']} linears", flush=True)
    row.update(
        torchtitan=_titan.titan_version(),
        cuda_graphs=cuda_graphs,
        activation_checkpoint=setup["activation_checkpoint"],
    )
    return run.step, row


def titan_dry_run(arm: str, cfg, recipe: str | None, args) -> dict:
    """The row of a titan arm under --dry-run: what can be checked without CUDA, checked."""
    _titan = titan_module()
    setup = titan_setup(arm, cfg, recipe, args)
    config = _titan.trainer_config(
        cfg, micro=args.micro, seq=args.seq, steps=args.steps, cuda_graphs=False, **setup
    )
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    row = checked_counts(arm, model, recipe)
    head = type(model.lm_head).__name__
    return {
        "arm": arm,
        "not_run": (
            f"torchtitan's Trainer needs CUDA; checked on CPU: Trainer.Config (activation checkpointing "
            f"{setup['activation_checkpoint']}, gas {args.gas}), {row['float8_linears']} Float8Linear of "
            f"{row['linears']} linears, lm_head {head}"
        ),
        "torchtitan": _titan.titan_version(),
        **row,
    }
