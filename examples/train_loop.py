"""The training loop of the example scripts: build the engine (pipelined or not), resume, train with
progress lines, validation and checkpoints, and summarise the run.

    engine = build_engine(args, mesh, cfg, arch)          # or build_engine(..., chunk_factory=...)
    engine.data_loader = loop                             # its position is saved in checkpoints
    summary = run(args, engine, loop, val_loader, progress, ckpt_dir, items_per_step, rank0)
"""

from __future__ import annotations

import time
from pathlib import Path

import pretrain_common as common

import plait
from plait.layers import TransformerModel
from plait.layers.stages import build_stage_modules, layer_parameter_counts
from plait.parallel.pipeline.partition import partition_layers, stage_layers
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.parallel.pipeline.registry import placement


def build_engine(args, mesh, cfg, arch, chunk_factory=None):
    """The model (or this rank's pipeline stages) wrapped by ``plait.initialize``.

    ``chunk_factory(layers)`` builds one model chunk holding the global layer indices ``layers`` (a
    ``range``, or None for the whole model); default a ``TransformerModel`` of ``arch``."""
    sp = cfg.tensor_parallel.sequence_parallel and mesh.tp > 1
    recompute = "full" if getattr(args, "recompute", False) else None
    v = cfg.pipeline.virtual_stages
    pipelined = mesh.pp > 1 or v > 1
    if chunk_factory is not None and pipelined:
        n = arch.num_layers + 2
        weights = layer_parameter_counts(arch) if cfg.pipeline.partition == "parameters" else None
        parts = partition_layers(n, mesh.pp, v, cfg.pipeline.partition, weights)
        shape = placement(cfg.pipeline.schedule)
        chunks = [
            chunk_factory(layers) for layers in stage_layers(parts, mesh.pp, mesh.pp_rank, shape)
        ]
    elif pipelined:
        chunks = build_stage_modules(
            arch,
            mesh,
            v=v,
            method=cfg.pipeline.partition,
            sequence_parallel=sp,
            seed=args.seed,
            recompute=recompute,
            cp_method=cfg.context_parallel.method,
            device=mesh.device,
            schedule=cfg.pipeline.schedule,
        )
    elif chunk_factory is not None:
        model = chunk_factory(None)
    else:
        model = TransformerModel(
            arch,
            mesh,
            sequence_parallel=sp,
            seed=args.seed,
            recompute=recompute,
            cp_method=cfg.context_parallel.method,
            device=mesh.device,
        )
    if pipelined:
        costs = "measure" if cfg.pipeline.schedule_costs == "measure" else None
        model = PipelineParallel(
            chunks,
            mesh,
            cfg.pipeline.schedule,
            cfg.gradient_accumulation_steps,
            v,
            schedule_costs=costs,
            cuda_graphs=cfg.pipeline.cuda_graphs,
        )
    return plait.initialize(model, cfg, mesh=mesh)


def run(
    args, engine, loop, val_loader, progress, ckpt_dir: Path, items_per_step: int, rank0: bool
) -> dict:
    """Resume when a checkpoint says so, then train to ``args.steps`` (or ``--stop-at-step``).

    Returns the run summary (also written to the metrics file and printed on rank 0)."""
    step, client = 0, {}
    tag = common.resume_tag(args, ckpt_dir)
    if tag is not None:
        path, client = engine.load_checkpoint(str(ckpt_dir), tag)
        step = int(client.get("step", engine.global_steps))
        state = loop.state_dict()
        progress.say(
            f"resumed from {path} at step {step} (data epoch {state['epoch']}, "
            f"position {state['position']} of {state['num_samples']} samples)"
        )
    val_start = client.get("val_start")
    if val_start is None:
        val_start = common.validate(engine, val_loader, args.eval_batches)
        progress.record({"type": "val", "step": step, "val_loss": val_start})
        progress.say(f"step {step:>6}/{args.steps} | validation loss {val_start:.4f}")
    val_loss = client.get("val_loss", val_start)
    t_train, trained, window, save_secs = time.perf_counter(), 0, [], 0.0
    progress.skip_interval()
    progress.begin(step)
    while step < args.steps and step != args.stop_at_step:
        loss = float(engine.train_batch(loop))
        step += 1
        trained += 1
        window.append(loss)
        progress.add(items_per_step)
        common.maybe_crash(args, step)
        if step % args.log_every == 0 or step == args.steps:
            progress.train(step, args.steps, sum(window) / len(window), engine)
            window = []
        if step % args.eval_every == 0 or step == args.steps:
            val_loss = common.validate(engine, val_loader, args.eval_batches)
            progress.record({"type": "val", "step": step, "val_loss": val_loss})
            progress.say(f"step {step:>6}/{args.steps} | validation loss {val_loss:.4f}")
            progress.skip_interval()
        if step % args.save_every == 0 or step in (args.steps, args.stop_at_step):
            client = {"step": step, "val_start": val_start, "val_loss": val_loss}
            secs = common.save(engine, ckpt_dir, step, client, args.keep_last, rank0)
            save_secs += secs
            progress.say(f"saved checkpoint step{step} in {secs:.1f}s")
            progress.skip_interval()
    t_train = time.perf_counter() - t_train
    mesh = engine.mesh
    unit = progress.unit
    summary = {
        "type": "summary",
        "step": step,
        "steps_this_run": trained,
        "val_loss_start": val_start,
        "val_loss_end": val_loss,
        "train_seconds": t_train,
        "checkpoint_seconds": save_secs,
        f"{unit}_per_s": trained * items_per_step / t_train if trained else None,
        "peak_mem_gib": common.peak_memory_gib(mesh.device)[0],
        "layout": [mesh.tp, mesh.pp, mesh.dp],
    }
    progress.record(summary)
    rate = f", {summary[f'{unit}_per_s']:,.1f} {unit}/s" if trained else ""
    progress.say(
        f"\nrun summary: step {step}/{args.steps} ({trained} this launch in {common.fmt_time(t_train)}"
        f"{rate}); validation loss {val_start:.4f} -> {val_loss:.4f}; peak memory "
        f"{summary['peak_mem_gib']:.2f} GiB on rank 0; checkpoints in {ckpt_dir}"
    )
    if step >= args.steps and trained == 0:
        progress.say(
            f"(the run in {ckpt_dir.parent} had already reached step {step}: raise --steps to train "
            f"further, or pass --resume never / another --out-dir to start over)"
        )
    return summary
