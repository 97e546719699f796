"""``Engine.save_checkpoint`` / ``load_checkpoint``: save any ``Checkpointable`` (``plait.checkpoint.contract``)
and load into one, at any layout.

What a rank writes (every element exactly once): its model chunks' weights (``model_io.model_shard_items``:
dp rank 0; tp-replicated ones from tp rank 0; each pipeline stage its own layers), gathered first under
ZeRO-3; and the optimizer's ZeRO pieces (``optimizer_io``). ``meta.json`` holds ``engine`` (steps, samples,
optimizer hyper-parameters and scalar state, loss scaler, schedule), ``config`` (the resolved ds_config),
``client_state``, ``data_loader`` when kept, and ``model_config`` / ``mesh`` from ``model_io``;
``rank_meta.json`` holds each rank's RNG states.

A load is one pass: the index (``CheckpointReader`` checks the whole checkpoint) -> the plan (every model
chunk's parameters matched to their tensors, shapes and config checked, nothing changed yet) -> the reads
into this rank's shards (model weights, then the optimizer's flat pieces, then RNG and trainer state). Only
the boxes the new layout needs are read, so tp, pp, dp and the ZeRO stage all may change on resume.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.checkpoint.contract import Checkpointable, RngState, TrainerState
from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.meta import tensor_from_json, tensor_to_json
from plait.checkpoint.model_io import model_meta, model_shard_items
from plait.checkpoint.model_load import fill_model, plan_model_load
from plait.checkpoint.optimizer_io import flat_reader, optimizer_items, param_table
from plait.checkpoint.reader import CheckpointReader
from plait.zero.slices import ShardState


def _engine_meta(state: ShardState, trainer: TrainerState, client_state: dict) -> dict:
    meta = {
        "engine": {
            "global_steps": state.global_steps,
            "skipped_steps": state.skipped_steps,
            "global_samples": trainer.global_samples,
            "zero_stage": state.stage,
            "optimizer_groups": {
                str(k): {
                    "hyper": {
                        h: list(v) if isinstance(v, tuple) else v for h, v in g["hyper"].items()
                    },
                    "scalars": g["scalars"],
                    "elementwise": g["elementwise"],
                    "state_dtype": g.get("state_dtype", "fp32"),
                }
                for k, g in state.groups.items()
            },
            "loss_scaler": state.loss_scaler,
            "lr_scheduler": trainer.lr_scheduler,
        },
        "config": trainer.config,
        "client_state": client_state,
    }
    if trainer.data_loader is not None:
        meta["data_loader"] = trainer.data_loader
    return meta


def _rng_to_json(rng: RngState) -> dict:
    out = {"torch": tensor_to_json(rng.cpu)}
    if rng.cuda is not None:
        out["cuda"] = tensor_to_json(rng.cuda)
    for i, states in rng.trackers.items():
        out[f"tracker{i}"] = {k: tensor_to_json(v) for k, v in states.items()}
    return out


def _refuse_nonfinite(state: ShardState, save_dir, tag: str, device) -> None:
    """Raise ``CheckpointError`` on every rank, before anything is written, when any rank's fp32 masters or
    optimizer state hold inf/nan: a save must never replace (as ``latest``) or prune a good checkpoint
    with a broken one. One pass over this rank's shard and one all-reduce of a flag. Collective."""
    bad = next(
        (
            f"{kind} of {s.name}"
            for s in state.slices
            for kind, t in (("master", s.master), *s.state.items())
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())
        ),
        None,
    )
    flag = torch.tensor([0.0 if bad is None else 1.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        where = f"this rank's {bad}" if bad else "another rank's shard"
        raise CheckpointError(
            f"refusing to save checkpoint {tag!r} in {save_dir}: {where} holds inf/nan; nothing was "
            "written, latest still names the last good checkpoint and none was pruned. Resume from "
            "it (engine.load_checkpoint) and look for the step that diverged"
        )


def save_engine(
    target: Checkpointable,
    save_dir,
    tag,
    client_state: dict,
    async_save: bool,
    keep_last: int | None = None,
):
    """Save ``target`` as ``save_dir/tag`` (default tag ``global_step<N>``). Collective; returns the checkpoint
    writer's handle (``.wait()`` it for async saves).

    Raises:
        CheckpointError: a rank's master weights or optimizer state hold inf/nan (nothing is written), or as
            ``CheckpointWriter.save``.
    """
    tag = tag or f"global_step{target.global_steps}"
    state = target.optimizer.shard_state()
    _refuse_nonfinite(state, save_dir, tag, target.mesh.device)
    writer = target.checkpoint_writer.writer(save_dir, keep_last)
    chunks = target.model_chunks()
    with target.optimizer.gathered_parameters():
        items = [item for chunk in chunks for item in model_shard_items(chunk, target.mesh)]
        items += optimizer_items(param_table(chunks, target.optimizer), state, target.mesh)
        meta = model_meta(
            chunks[0], target.mesh, _engine_meta(state, target.trainer_state(), client_state)
        )
        return writer.save(
            tag, items, meta, rank_meta=_rng_to_json(target.rng_state()), async_=async_save
        )


def _saved_state(meta: dict) -> ShardState:
    e = meta["engine"]
    groups = {
        int(k): {
            "hyper": {h: tuple(v) if isinstance(v, list) else v for h, v in g["hyper"].items()},
            "scalars": g["scalars"],
            "elementwise": g["elementwise"],
            "state_dtype": g.get("state_dtype", "fp32"),
        }
        for k, g in e["optimizer_groups"].items()
    }
    return ShardState(
        [], groups, e["loss_scaler"], e["global_steps"], e["skipped_steps"], e["zero_stage"], 0, 0
    )


def _saved_trainer_state(meta: dict, load_lr_scheduler_states: bool) -> TrainerState:
    e = meta.get("engine")
    return TrainerState(
        global_samples=e.get("global_samples", 0) if e is not None else None,
        lr_scheduler=e.get("lr_scheduler") if e is not None and load_lr_scheduler_states else None,
        data_loader=meta.get("data_loader"),
    )


def _saved_rng(reader: CheckpointReader, mesh) -> RngState | None:
    """This rank's saved RNG states; None when the checkpoint was saved by another number of ranks."""
    rank_meta = reader.rank_meta()
    if rank_meta is None or len(rank_meta) != mesh.world_size:
        return None
    mine = rank_meta[mesh.global_rank]
    trackers = {
        int(k[len("tracker") :]): {n: tensor_from_json(v) for n, v in states.items()}
        for k, states in mine.items()
        if k.startswith("tracker")
    }
    return RngState(
        tensor_from_json(mine["torch"]),
        tensor_from_json(mine["cuda"]) if "cuda" in mine else None,
        trackers,
    )


def load_engine(
    target: Checkpointable,
    load_dir,
    tag,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    strict: bool,
    allow_config_change: bool = False,
):
    """Load checkpoint ``load_dir/tag`` (default: ``latest``) into ``target`` (the module docstring's one pass).
    Collective; returns ``(checkpoint path, client_state)``.

    Raises:
        CheckpointError: as ``CheckpointReader`` and ``model_load.load_model_weights`` (shapes, config, with
            ``strict`` missing or unexpected weights), before any parameter is changed.
    """
    reader = CheckpointReader(load_dir, tag)
    meta, chunks = reader.meta, target.model_chunks()
    with target.optimizer.gathered_parameters():
        plans = [plan_model_load(chunk, reader, strict, allow_config_change)[0] for chunk in chunks]
        for chunk, plan in zip(chunks, plans):
            fill_model(chunk, reader, plan)
    state = _saved_state(meta) if "engine" in meta and load_optimizer_states else None
    target.optimizer.load_shard_state(
        flat_reader(reader, param_table(chunks, target.optimizer)), state
    )
    rng = _saved_rng(reader, target.mesh)
    if rng is not None:
        target.load_rng_state(rng)
    target.load_trainer_state(_saved_trainer_state(meta, load_lr_scheduler_states))
    path = str(reader.path)
    reader.close()
    return path, meta.get("client_state", {})
