"""bench_llama8b's arms beyond bench_float8's (DeepSpeed ZeRO-3; plait tp=2 x dp and pp=2 x dp), and the model
FLOPs per token that its MFU counts.

Each builder is ``build(arm, cfg, device, args) -> step(i) -> loss`` for ``bench_float8.run_arm``, which
counts ``WORLD_SIZE x micro x gas x seq`` tokens per step. The tp and pp arms split the model over 2 ranks, so
``WORLD_SIZE / 2`` data-parallel ranks each run ``2 x gas`` micro-batches per step: the same global batch, and
the same tokens per step, as the data-parallel arms at the same ``--nproc``.
"""

from __future__ import annotations

import os

import torch
from _common import BETAS, LR, WEIGHT_DECAY, ds_like_config
from bench_float8 import batch, init_group

#: Dense peak of one H200 SXM (NVIDIA's H200 datasheet, without sparsity), FLOP/s.
PEAK_BF16, PEAK_FP8 = 989e12, 1979e12
#: The arms of this module: DeepSpeed's engine, plait at tp=2, plait at pp=2 (two schedules).
DS_ARMS = ("ds-z3",)
LAYOUT_ARMS = ("plait-tp2", "plait-pp2-zbh1", "plait-pp2-1f1b")
SPLIT = 2  # ranks one model replica spans in the tp and pp arms


def ds_arm(arm: str, cfg, device, args):
    """DeepSpeed ZeRO-3 over plait's ``TransformerModel`` (bench_llama_zero's ds arms at this shape): the
    same ds_config as plait's arms (bf16, overlap_comm, 50M buckets), torch's AdamW (fused on the GPU) with
    ``zero_allow_untested_optimizer``, every block recomputed when ``--recompute`` > 0 (the model's own
    checkpointing: DeepSpeed's needs the model to call it), eager (DeepSpeed's default)."""
    import deepspeed

    from plait.layers import TransformerModel

    init_group(device)
    config = ds_like_config(3)
    config.update(
        train_micro_batch_size_per_gpu=args.micro,
        gradient_accumulation_steps=args.gas,
        zero_allow_untested_optimizer=True,
    )
    del config["optimizer"]
    if args.dry_run:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    recompute = "full" if args.recompute else None
    model = TransformerModel(cfg, None, seed=0, device=device, recompute=recompute)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        betas=BETAS,
        fused=device.type == "cuda",
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(i):
        for j in range(args.gas):
            loss = engine(**batch(cfg, device, i * args.gas + j, args))
            engine.backward(loss)
            engine.step()
        return loss

    step.row = {"deepspeed": deepspeed.__version__}
    return step


def layout_config(arm: str, args, gas: int) -> dict:
    """The ds_config of a tp/pp arm: plait's ZeRO ``--stage``, ``gas`` micro-batches a step, compiled
    except under ZB-H1 (plait refuses compile there: its split backward cannot split a compiled block)."""
    config = ds_like_config(args.stage)
    config.update(train_micro_batch_size_per_gpu=args.micro, gradient_accumulation_steps=gas)
    if arm == "plait-tp2":
        config["tensor_parallel"] = {"size": SPLIT}
        config["activation_checkpointing"] = {"number_checkpoints": args.recompute}
    else:
        schedule = "zb-h1" if arm.endswith("zbh1") else "1f1b"
        config["pipeline"] = {"size": SPLIT, "schedule": schedule}
    if args.dry_run:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    elif arm != "plait-pp2-zbh1":
        config["compile"] = {"enabled": True, "backend": "inductor"}
    return config


def layout_arm(arm: str, cfg, device, args):
    """plait at tp=2 (``TransformerModel`` over the mesh's tp ranks) or pp=2 (``build_stage_modules`` +
    ``PipelineParallel``, ZB-H1 or 1F1B), ZeRO ``--stage`` over the remaining ``WORLD_SIZE / 2`` ranks.
    ValueError at an odd ``WORLD_SIZE``."""
    import plait
    from plait.layers import TransformerModel
    from plait.layers.stages import build_stage_modules
    from plait.parallel import ParallelMesh
    from plait.parallel.pipeline.parallel import PipelineParallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % SPLIT:
        raise ValueError(
            f"{arm} splits the model over {SPLIT} ranks: run it at an even --nproc, not {world}"
        )
    gas = args.gas * SPLIT
    config = layout_config(arm, args, gas)
    init_group(device)
    if arm == "plait-tp2":
        mesh = ParallelMesh(tp=SPLIT)
        engine = plait.initialize(
            TransformerModel(cfg, mesh, seed=0, device=device), config, mesh=mesh
        )

        def step(i):
            for j in range(gas):
                loss = engine(**batch(cfg, device, i * gas + j, args))
                engine.backward(loss)
                engine.step()
            return loss

    else:
        mesh = ParallelMesh(tp=1, pp=SPLIT)
        schedule = config["pipeline"]["schedule"]
        recompute = "full" if args.recompute else None
        chunks = build_stage_modules(
            cfg, mesh, seed=0, recompute=recompute, device=device, schedule=schedule
        )
        pipe = PipelineParallel(chunks, mesh, schedule=schedule, micro_batches=gas)
        engine = plait.initialize(pipe, config, mesh=mesh)

        def step(i):
            return engine.train_batch(
                iter([batch(cfg, device, i * gas + j, args) for j in range(gas)])
            )

    step.row = {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, "micro_batches": gas}
    return step


def build(arm: str, cfg, device, args):
    """The builder for ``bench_float8.run_arm``: this module's arms, else bench_float8's (None)."""
    if arm in DS_ARMS:
        return ds_arm(arm, cfg, device, args)
    if arm in LAYOUT_ARMS:
        return layout_arm(arm, cfg, device, args)
    from bench_float8 import fsdp2_arm, plait_arm

    return (plait_arm if arm.startswith("plait") else fsdp2_arm)(arm, cfg, device, args)
