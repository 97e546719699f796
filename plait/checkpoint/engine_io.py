"""``Engine.save_checkpoint`` / ``load_checkpoint``: model weights, ZeRO master weights and optimizer
state as logical tensors, plus the engine's counters, schedule, loss scaler and RNG states.

What a rank writes (every element exactly once):

- model weights: ``model_io.model_shard_items`` (dp rank 0; tp-replicated ones from tp rank 0;
  each pipeline stage its own layers), gathered first under ZeRO-3;
- ``optimizer.master.<name>`` and ``optimizer.<state>.<name>``: each rank's ZeRO pieces of each
  parameter (a flattened range of its tp-local shard), stored as boxes of the logical tensor with
  vocabulary padding dropped; stage 0 (replicated) from dp rank 0 only; tp-replicated parameters
  from tp rank 0 only; tied head copies not at all (the embedding's entries serve both).

``meta.json`` holds ``engine`` (steps, samples, optimizer hyper-parameters and scalar state, loss
scaler, schedule), ``config`` (the resolved ds_config), ``client_state``, and ``model_config`` /
``mesh`` from ``model_io``; ``rank_meta.json`` holds each rank's RNG states. Loading reads only
the boxes this rank's new layout needs, so tp, pp, dp, ZeRO stage all may change on resume.
"""
from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.checkpoint.boxes import flat_range_boxes
from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.index import optimizer_key
from plait.checkpoint.meta import tensor_from_json, tensor_to_json
from plait.checkpoint.model_io import checkpoint_name, load_model_weights, model_meta, model_shard_items
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.writer import CheckpointWriter, ShardItem
from plait.parallel.sharding import TPShard, logical_parts, split_flat
from plait.zero.flat import ShardState

_CHUNK_PREFIX = re.compile(r"^\d+\.")


def _chunks(engine) -> list:
    return list(engine.pipeline.stage_modules) if engine.pipeline is not None else [engine.module]


def _param_table(engine) -> dict:
    """ZeRO slot name -> (the ``LogicalPart``s under their checkpoint names, parameter)."""
    table = {}
    strip = engine.pipeline is not None
    chunk_params = {}
    for chunk in _chunks(engine):
        for name, p in chunk.named_parameters():
            chunk_params[id(p)] = (name, chunk)
    for name, p in engine.optimizer.module.named_parameters():
        own, chunk = chunk_params.get(id(p), (_CHUNK_PREFIX.sub("", name) if strip else name, engine.module))
        table[name] = (logical_parts(checkpoint_name(own, p, chunk), p), p)
    return table


def _logical_boxes(spec: TPShard, start: int, length: int):
    """``(local_flat_offset, offsets, lengths)`` boxes of the logical tensor holding the flattened
    local-shard elements ``[start, start + length)``; padding rows are left out."""
    valid = None
    tp_start = 0
    if spec.dim is not None:
        tp_start, tp_stop = spec.logical_range()
        valid = tp_stop - tp_start
    pos = 0
    for offsets, lengths in flat_range_boxes(spec.local_shape, start, start + length):
        n = 1
        for s in lengths:
            n *= s
        offsets, lengths = list(offsets), list(lengths)
        keep = lengths
        if valid is not None:
            d = spec.dim
            rows = max(0, min(offsets[d] + lengths[d], valid) - offsets[d])
            keep = lengths[:d] + [rows] + lengths[d + 1:]
            offsets[d] += tp_start
        yield pos, tuple(offsets), tuple(lengths), tuple(keep)
        pos += n


def _optimizer_items(engine, state: ShardState) -> list[ShardItem]:
    mesh = engine.mesh
    if state.replicated and mesh.rank("dp_cp") != 0:
        return []
    table = _param_table(engine)
    items = []
    for sl in state.slices:
        parts, param = table[sl.name]
        if getattr(param, "plait_tied_to", None):
            continue
        for part, start, length, pos in split_flat(parts, sl.start, sl.length):
            if not part.spec.tp_split and mesh.tp_rank != 0:
                continue
            for kind, flat in [("master", sl.master)] + sorted(sl.state.items()):
                items += _part_items(optimizer_key(kind, part.name), part.spec, flat[pos:pos + length], start)
    return items


def _part_items(key: str, spec: TPShard, flat: torch.Tensor, start: int) -> list[ShardItem]:
    """``flat``, the local-shard elements ``[start, start + len(flat))`` of logical tensor ``key``'s
    shard ``spec``, as ``ShardItem`` boxes (padding rows dropped)."""
    items = []
    for pos, offsets, lengths, keep in _logical_boxes(spec, start, flat.numel()):
        box = flat[pos:pos + math.prod(lengths)].view(lengths)
        if spec.dim is not None:
            box = box.narrow(spec.dim, 0, keep[spec.dim])
        if box.numel():
            items.append(ShardItem(key, box.detach(), spec.logical_shape, offsets))
    return items


def _rng_state(engine) -> dict:
    out = {"torch": tensor_to_json(torch.get_rng_state())}
    if torch.cuda.is_available() and engine.mesh.device.type == "cuda":
        out["cuda"] = tensor_to_json(torch.cuda.get_rng_state())
    for i, chunk in enumerate(_chunks(engine)):
        tracker = getattr(chunk, "rng", None)
        if tracker is not None:
            out[f"tracker{i}"] = {k: tensor_to_json(v) for k, v in tracker.get_states().items()}
    return out


def _engine_meta(engine, state: ShardState, client_state: dict) -> dict:
    sched = engine.lr_scheduler
    meta = {
        "engine": {
            "global_steps": state.global_steps, "skipped_steps": state.skipped_steps,
            "global_samples": engine.global_samples, "zero_stage": state.stage,
            "optimizer_groups": {str(k): {"hyper": {h: list(v) if isinstance(v, tuple) else v
                                                     for h, v in g["hyper"].items()},
                                          "scalars": g["scalars"], "elementwise": g["elementwise"],
                                          "state_dtype": g.get("state_dtype", "fp32")}
                                 for k, g in state.groups.items()},
            "loss_scaler": state.loss_scaler,
            "lr_scheduler": sched.state_dict() if sched is not None else None,
        },
        "config": engine.config.to_dict(),
        "client_state": client_state,
    }
    loader = getattr(engine, "data_loader", None)
    if loader is not None and hasattr(loader, "state_dict"):
        meta["data_loader"] = loader.state_dict()
    return model_meta(_chunks(engine)[0], engine.mesh, meta)


def _refuse_nonfinite(state: ShardState, save_dir, tag: str, device) -> None:
    """Raise ``CheckpointError`` on every rank, before anything is written, when any rank's fp32 masters or
    optimizer state hold inf/nan: a save must never replace (as ``latest``) or prune a good checkpoint
    with a broken one. One pass over this rank's shard and one all-reduce of a flag. Collective."""
    bad = next((f"{kind} of {s.name}" for s in state.slices for kind, t in (("master", s.master), *s.state.items())
                if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())), None)
    flag = torch.tensor([0.0 if bad is None else 1.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        where = f"this rank's {bad}" if bad else "another rank's shard"
        raise CheckpointError(f"refusing to save checkpoint {tag!r} in {save_dir}: {where} holds inf/nan; nothing was "
                              "written, latest still names the last good checkpoint and none was pruned. Resume from "
                              "it (engine.load_checkpoint) and look for the step that diverged")


def save_engine(engine, save_dir, tag, client_state: dict, async_save: bool, keep_last: int | None = None):
    """Collective; returns the checkpoint writer's handle (``.wait()`` it for async saves)."""
    tag = tag or f"global_step{engine.global_steps}"
    state = engine.optimizer.shard_state()
    _refuse_nonfinite(state, save_dir, tag, engine.mesh.device)
    writer = getattr(engine, "_checkpoint_writer", None)
    if writer is None or str(writer.root) != str(save_dir) or writer.keep_last != keep_last:
        if writer is not None:
            writer.wait()
        writer = engine._checkpoint_writer = CheckpointWriter(save_dir, keep_last=keep_last)
    with engine.optimizer.gathered_parameters():
        items = [item for chunk in _chunks(engine) for item in model_shard_items(chunk, engine.mesh)]
        items += _optimizer_items(engine, state)
        return writer.save(tag, items, _engine_meta(engine, state, client_state),
                           rank_meta=_rng_state(engine), async_=async_save)


def _flat_reader(reader: CheckpointReader, table: dict, load_optimizer_states: bool):
    """``read(slot_name, kind, start, length)`` for ``ZeroOptimizer.load_shard_state``."""
    names = set(reader.names())

    def read(slot: str, kind: str, start: int, length: int) -> torch.Tensor:
        parts, _ = table[slot]
        out = [_read_part(reader, names, kind, part, lo, n) for part, lo, n, _ in split_flat(parts, start, length)]
        return torch.cat(out) if out else torch.zeros(0)

    return read


def _read_part(reader: CheckpointReader, names: set, kind: str, part, start: int, length: int) -> torch.Tensor:
    """float32 elements ``[start, start + length)`` of ``part``'s local shard, padding rows zero."""
    spec = part.spec
    key = optimizer_key(kind, part.name)
    if kind == "master" and key not in names:
        key = part.name                             # no master saved (e.g. a converted checkpoint)
    out = []
    for _, offsets, lengths, keep in _logical_boxes(spec, start, length):
        got = reader.read(key, offsets, keep, dtype=torch.float32)
        if keep != lengths:
            d = spec.dim
            got = F.pad(got, [0, 0] * (got.dim() - 1 - d) + [0, lengths[d] - keep[d]])
        out.append(got.reshape(-1))
    return torch.cat(out) if out else torch.zeros(0)


def _saved_state(meta: dict) -> ShardState:
    e = meta["engine"]
    groups = {int(k): {"hyper": {h: tuple(v) if isinstance(v, list) else v for h, v in g["hyper"].items()},
                       "scalars": g["scalars"], "elementwise": g["elementwise"],
                       "state_dtype": g.get("state_dtype", "fp32")}
              for k, g in e["optimizer_groups"].items()}
    return ShardState([], groups, e["loss_scaler"], e["global_steps"], e["skipped_steps"], e["zero_stage"], 0, 0)


def load_engine(engine, load_dir, tag, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                strict: bool, allow_config_change: bool = False):
    """Collective; returns ``(checkpoint path, client_state)``."""
    reader = CheckpointReader(load_dir, tag)
    meta = reader.meta
    with engine.optimizer.gathered_parameters():
        for chunk in _chunks(engine):
            load_model_weights(chunk, reader, strict=strict, allow_config_change=allow_config_change)
    has_engine = "engine" in meta
    state = _saved_state(meta) if has_engine and load_optimizer_states else None
    engine.optimizer.load_shard_state(_flat_reader(reader, _param_table(engine), state is not None), state)
    if has_engine:
        e = meta["engine"]
        engine.global_samples = e.get("global_samples", 0)
        if load_lr_scheduler_states and engine.lr_scheduler is not None and e.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(e["lr_scheduler"])
    rank_meta = reader.rank_meta()
    if rank_meta is not None and len(rank_meta) == engine.mesh.world_size:
        mine = rank_meta[engine.mesh.global_rank]
        torch.set_rng_state(tensor_from_json(mine["torch"]))
        if "cuda" in mine and engine.mesh.device.type == "cuda":
            torch.cuda.set_rng_state(tensor_from_json(mine["cuda"]))
        for i, chunk in enumerate(_chunks(engine)):
            tracker = getattr(chunk, "rng", None)
            if tracker is not None and f"tracker{i}" in mine:
                tracker.set_states({k: tensor_from_json(v) for k, v in mine[f"tracker{i}"].items()})
    loader = getattr(engine, "data_loader", None)
    if loader is not None and "data_loader" in meta and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(meta["data_loader"])
    path = str(reader.path)
    reader.close()
    return path, meta.get("client_state", {})
