"""Save a model's weights in any tensor/pipeline/data-parallel layout, and the names they are stored under.

``save_model_weights`` is collective over the writer's group (every rank calls it); each rank contributes
only the boxes it owns, so every logical element (tp shards, replicated tensors, expert shards, training-state
buffers, each pipeline stage's layers) is written exactly once; a tied head copy (``plait_tied_to``) is not
saved. Loading is ``model_load``.

``meta.json`` holds the architecture under :data:`MODEL_CONFIG_KEY` (``TransformerConfig.to_dict()``) and the
saving layout under :data:`MESH_KEY`; ``config_from_meta`` rebuilds the config. Names starting with
:data:`EXTRA_PREFIX` (kept only for Hugging Face export) or ``optimizer.`` are not model weights.
Which rank writes what: ``docs/checkpoints.md``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.hf_native import HF_MODEL_KEY, hf_model_meta
from plait.checkpoint.tp import tp_shard_item
from plait.checkpoint.writer import CheckpointWriter, SaveHandle, ShardItem
from plait.layers.config import TransformerConfig
from plait.layers.init import TIED_ATTR
from plait.layers.ends import EMBEDDING_WEIGHT
from plait.models.registry import get_family
from plait.parallel.sharding import logical_parts

#: ``meta.json`` key holding ``TransformerConfig.to_dict()`` of the saved model.
MODEL_CONFIG_KEY = "model_config"
#: ``meta.json`` key holding the saving layout ``{"tp": .., "pp": .., "dp": .., "ep": ..}``.
MESH_KEY = "mesh"
#: Prefix of tensors that are no plait parameter (kept for export only); never loaded into a model.
EXTRA_PREFIX = "hf_extra."


def is_tied_copy(param: torch.Tensor) -> bool:
    """Whether ``param`` is a tied copy (``plait_tied_to``): stored only under the original's name."""
    return bool(getattr(param, TIED_ATTR, None))


def checkpoint_name(name: str, param: torch.Tensor, model: nn.Module | None = None) -> str:
    """The logical name a parameter is stored under: its own, or for a tied copy the original's.

    A tied copy carries ``plait_tied_to``; with ``model`` given, the head weight of a tied
    ``TransformerModel`` also maps to the embedding (``to_empty`` on a meta model unties the
    shared parameter and the copy has no attribute).
    """
    tied = getattr(param, TIED_ATTR, None)
    if tied:
        return tied
    config = getattr(model, "config", None)
    if (
        isinstance(config, TransformerConfig)
        and config.tie_embeddings
        and name == f"layers.{config.num_layers + 1}.weight"
    ):
        return EMBEDDING_WEIGHT
    return name


def _mesh_coords(mesh) -> dict[str, int]:
    if mesh is None:
        return {"tp": 1, "pp": 1, "dp": 1, "tp_rank": 0, "dp_rank": 0, "edp_rank": 0}
    # dp_rank: whether this rank writes the model's shards (one writer per tp x pp coordinate, cp ranks included);
    # edp_rank: the same for expert shards (one writer per tp x pp x ep coordinate)
    return {
        "tp": mesh.tp,
        "pp": mesh.pp,
        "dp": mesh.dp,
        "ep": mesh.ep,
        "tp_rank": mesh.tp_rank,
        "dp_rank": mesh.rank("dp_cp"),
        "edp_rank": mesh.rank("edp") * mesh.cp + mesh.cp_rank,
    }


def _writes(spec, coords: dict) -> bool:
    """Whether this rank writes the shard ``spec`` (the module docstring's rules)."""
    first = coords["edp_rank"] if spec.axis == "ep" else coords["dp_rank"]
    return first == 0 and (spec.tp_split or coords["tp_rank"] == 0)


def model_shard_items(model: nn.Module, mesh=None) -> list:
    """The ``ShardItem``s this rank owns for ``model``'s parameters (see the module docstring)."""
    coords = _mesh_coords(mesh)
    if coords["edp_rank"] != 0:
        return []
    items = []
    for name, param in model.named_parameters():
        if checkpoint_name(name, param, model) != name:
            continue  # a tied copy: the embedding's stage saves it
        for part in logical_parts(name, param):
            if not _writes(part.spec, coords):
                continue
            item = tp_shard_item(part.name, part.local(param.detach()), part.spec)
            if item is not None:
                items.append(item)
    if coords["dp_rank"] == 0 and coords["tp_rank"] == 0:
        items += [
            ShardItem(name, buf.detach(), tuple(buf.shape), (0,) * buf.dim())
            for name, buf in state_buffers(model)
        ]
    return items


def state_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every buffer a module of ``model`` declares as training state
    (``checkpointed_buffers``, e.g. ``MoE.expert_bias``)."""
    return [
        (f"{prefix}.{b}" if prefix else b, getattr(module, b))
        for prefix, module in model.named_modules()
        for b in getattr(module, "checkpointed_buffers", ())
    ]


def model_meta(model: nn.Module, mesh=None, meta: dict | None = None) -> dict:
    """``meta`` plus the model's config (:data:`MODEL_CONFIG_KEY`) and the layout (:data:`MESH_KEY`)."""
    out = dict(meta or {})
    config = getattr(model, "config", None)
    # A hand-composed model may reuse TransformerConfig for its sizes without being that architecture:
    # it sets ``plait_architecture = "custom"`` so the checkpoint does not claim to be GPT-2/Llama/BERT.
    if (
        isinstance(config, TransformerConfig)
        and getattr(model, "plait_architecture", None) != "custom"
    ):
        out.setdefault(MODEL_CONFIG_KEY, config.to_dict())
    elif (hf_model := hf_model_meta(model)) is not None:  # a transformers model trained as it is
        out.setdefault(HF_MODEL_KEY, hf_model)
    coords = _mesh_coords(mesh)
    out.setdefault(MESH_KEY, {k: coords[k] for k in ("tp", "pp", "dp", "ep") if k in coords})
    return out


def save_model_weights(
    model: nn.Module,
    mesh,
    writer_or_root: CheckpointWriter | str | os.PathLike,
    tag: str,
    meta: dict | None = None,
    *,
    async_: bool = False,
) -> SaveHandle:
    """Save ``model``'s weights as checkpoint ``tag``; collective over the writer's group.

    Args:
        model: this rank's model or pipeline stage (parameters carry ``TPShard``s).
        mesh: the ``ParallelMesh`` it was built with (None: one process).
        writer_or_root: a ``CheckpointWriter`` (its group must hold every rank of the mesh) or a
            root directory (a writer over the default group is made).
        tag: checkpoint name, e.g. ``"step1000"``.
        meta: JSON dict for ``meta.json``; the config and layout are added (see ``model_meta``).
        async_: write in a background thread (``handle.wait()`` finishes it).

    Raises:
        CheckpointError: as ``CheckpointWriter.save`` (e.g. a tensor not tiled because ranks
            disagree on the layout).
    """
    writer = (
        writer_or_root
        if isinstance(writer_or_root, CheckpointWriter)
        else CheckpointWriter(writer_or_root)
    )
    return writer.save(
        tag, model_shard_items(model, mesh), model_meta(model, mesh, meta), async_=async_
    )


def config_from_meta(meta: dict, where: str = "checkpoint") -> TransformerConfig:
    """The ``TransformerConfig`` stored under :data:`MODEL_CONFIG_KEY`.

    Raises:
        CheckpointError: the key is missing or does not describe a valid config.
    """
    raw = meta.get(MODEL_CONFIG_KEY)
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{where}: meta.json has no {MODEL_CONFIG_KEY!r} dict (saved without "
            f"save_model_weights?); pass the TransformerConfig explicitly"
        )
    try:  # the family's factory: fields a checkpoint saved before they existed take the family's values
        return get_family(raw.get("arch")).make_config(**raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{where}: meta[{MODEL_CONFIG_KEY!r}] is not a valid TransformerConfig: {e}"
        ) from None
