"""Save and load a model's weights in any tensor/pipeline/data-parallel layout.

``save_model_weights`` is collective over the writer's group (every rank calls it); each rank contributes
only the boxes it owns, so every logical element (tp shards, replicated tensors, expert shards, training-state
buffers, each pipeline stage's layers) is written exactly once; a tied head copy (``plait_tied_to``) is not
saved. ``load_model_weights`` fills every local parameter of any layout from any saved layout, reading only
this rank's box of each tensor (``read_tp_shard``); vocabulary padding rows are zero-filled.

``meta.json`` holds the architecture under :data:`MODEL_CONFIG_KEY` (``TransformerConfig.to_dict()``) and the
saving layout under :data:`MESH_KEY`; ``config_from_meta`` rebuilds the config. Names starting with
:data:`EXTRA_PREFIX` (kept only for Hugging Face export) or ``optimizer.`` are not model weights and are
ignored on load. Which rank writes what: ``docs/checkpoints.md``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.hf_native import HF_MODEL_KEY, hf_model_meta
from plait.checkpoint.index import OPTIMIZER_PREFIX
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.tp import read_tp_shard, tp_shard_item
from plait.checkpoint.writer import CheckpointWriter, SaveHandle, ShardItem
from plait.layers.config import TransformerConfig
from plait.layers.init import TIED_ATTR
from plait.layers.ends import EMBEDDING_WEIGHT
from plait.models.registry import get_family
from plait.parallel.sharding import TPShard, logical_parts

#: ``meta.json`` key holding ``TransformerConfig.to_dict()`` of the saved model.
MODEL_CONFIG_KEY = "model_config"
#: ``meta.json`` key holding the saving layout ``{"tp": .., "pp": .., "dp": .., "ep": ..}``.
MESH_KEY = "mesh"
#: Prefix of tensors that are no plait parameter (kept for export only); never loaded into a model.
EXTRA_PREFIX = "hf_extra."

_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass
class LoadReport:
    """What ``load_model_weights(strict=False)`` could not match.

    ``missing``: this model's parameters the checkpoint lacks (they keep their current values);
    ``unexpected``: checkpoint model weights that belong to this model's layers (or to no layer
    of its architecture) but match no parameter. Weights of layers this pipeline stage did not
    build are neither.
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


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
    if (isinstance(config, TransformerConfig) and config.tie_embeddings
            and name == f"layers.{config.num_layers + 1}.weight"):
        return EMBEDDING_WEIGHT
    return name


def _mesh_coords(mesh) -> dict[str, int]:
    if mesh is None:
        return {"tp": 1, "pp": 1, "dp": 1, "tp_rank": 0, "dp_rank": 0, "edp_rank": 0}
    # dp_rank: whether this rank writes the model's shards (one writer per tp x pp coordinate, cp ranks included);
    # edp_rank: the same for expert shards (one writer per tp x pp x ep coordinate)
    return {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, "ep": mesh.ep, "tp_rank": mesh.tp_rank,
            "dp_rank": mesh.rank("dp_cp"), "edp_rank": mesh.rank("edp") * mesh.cp + mesh.cp_rank}


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
            continue                        # a tied copy: the embedding's stage saves it
        for part in logical_parts(name, param):
            if not _writes(part.spec, coords):
                continue
            item = tp_shard_item(part.name, part.local(param.detach()), part.spec)
            if item is not None:
                items.append(item)
    if coords["dp_rank"] == 0 and coords["tp_rank"] == 0:
        items += [ShardItem(name, buf.detach(), tuple(buf.shape), (0,) * buf.dim())
                  for name, buf in state_buffers(model)]
    return items


def state_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every buffer a module of ``model`` declares as training state
    (``checkpointed_buffers``, e.g. ``MoE.expert_bias``)."""
    return [(f"{prefix}.{b}" if prefix else b, getattr(module, b)) for prefix, module in model.named_modules()
            for b in getattr(module, "checkpointed_buffers", ())]


def model_meta(model: nn.Module, mesh=None, meta: dict | None = None) -> dict:
    """``meta`` plus the model's config (:data:`MODEL_CONFIG_KEY`) and the layout (:data:`MESH_KEY`)."""
    out = dict(meta or {})
    config = getattr(model, "config", None)
    # A hand-composed model may reuse TransformerConfig for its sizes without being that architecture:
    # it sets ``plait_architecture = "custom"`` so the checkpoint does not claim to be GPT-2/Llama/BERT.
    if isinstance(config, TransformerConfig) and getattr(model, "plait_architecture", None) != "custom":
        out.setdefault(MODEL_CONFIG_KEY, config.to_dict())
    elif (hf_model := hf_model_meta(model)) is not None:    # a transformers model trained as it is
        out.setdefault(HF_MODEL_KEY, hf_model)
    coords = _mesh_coords(mesh)
    out.setdefault(MESH_KEY, {k: coords[k] for k in ("tp", "pp", "dp", "ep") if k in coords})
    return out


def save_model_weights(model: nn.Module, mesh, writer_or_root: CheckpointWriter | str | os.PathLike,
                       tag: str, meta: dict | None = None, *, async_: bool = False) -> SaveHandle:
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
    writer = writer_or_root if isinstance(writer_or_root, CheckpointWriter) else CheckpointWriter(writer_or_root)
    return writer.save(tag, model_shard_items(model, mesh), model_meta(model, mesh, meta), async_=async_)


def config_from_meta(meta: dict, where: str = "checkpoint") -> TransformerConfig:
    """The ``TransformerConfig`` stored under :data:`MODEL_CONFIG_KEY`.

    Raises:
        CheckpointError: the key is missing or does not describe a valid config.
    """
    raw = meta.get(MODEL_CONFIG_KEY)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: meta.json has no {MODEL_CONFIG_KEY!r} dict (saved without "
                              f"save_model_weights?); pass the TransformerConfig explicitly")
    try:   # the family's factory: fields a checkpoint saved before they existed take the family's values
        return get_family(raw.get("arch")).make_config(**raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: meta[{MODEL_CONFIG_KEY!r}] is not a valid TransformerConfig: {e}") from None


def _is_model_weight(name: str) -> bool:
    return not name.startswith((OPTIMIZER_PREFIX, EXTRA_PREFIX))


def _elsewhere(name: str, model: nn.Module) -> bool:
    """True if ``name`` belongs to a layer of the architecture that this stage did not build."""
    indices = getattr(model, "layer_indices", None)
    config = getattr(model, "config", None)
    m = _LAYER.match(name)
    if indices is None or config is None or m is None:
        return False
    i = int(m.group(1))
    return 0 <= i < config.num_layers + 2 and i not in indices


# TransformerConfig fields that change what the same weights compute: a checkpoint whose recorded config
# differs in one of them is refused unless the caller allows it (``allow_config_change``).
COMPUTE_FIELDS = ("arch", "num_heads", "num_kv_heads", "activation", "norm", "norm_eps", "rope_theta",
                  "tie_embeddings", "causal", "post_norm", "qk_norm", "moe_top_k", "moe_router_order",
                  "moe_normalize_topk")


def check_model_config(model: nn.Module, reader: CheckpointReader) -> None:
    """Refuse a checkpoint whose recorded model config (``meta.json``, :data:`MODEL_CONFIG_KEY`) differs from
    ``model.config`` in a field of :data:`COMPUTE_FIELDS`: same shapes, another computation.

    Raises:
        CheckpointError: naming every differing field with the checkpoint's and the model's value.
    """
    saved, config = reader.meta.get(MODEL_CONFIG_KEY), getattr(model, "config", None)
    if not isinstance(saved, dict) or not isinstance(config, TransformerConfig):
        return
    mine = config.to_dict()
    diff = [f"{k}: checkpoint {saved[k]!r}, model {mine[k]!r}" for k in COMPUTE_FIELDS
            if k in saved and saved[k] != mine.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint {reader.path} was saved from a model that computes differently ("
                              + "; ".join(diff) + "): build the model with the checkpoint's config "
                              f"(meta[{MODEL_CONFIG_KEY!r}]), or pass allow_config_change=True to load it anyway")


@torch.no_grad()
def load_model_weights(model: nn.Module, reader: CheckpointReader | str | os.PathLike, strict: bool = True,
                       tag: str | None = None, device=None, allow_config_change: bool = False) -> LoadReport:
    """Fill every parameter of ``model`` (any tp/pp layout) from a checkpoint of any layout.

    Each parameter reads only its own box (``read_tp_shard``), converted to the parameter's dtype;
    vocabulary padding rows become zero. A tied head copy (``plait_tied_to``) reads the embedding's
    weight. Shapes are checked for all parameters before any is changed.

    Args:
        model: model or pipeline stage. Parameters on the meta device (a model built with
            ``device="meta"``, too big to initialize) are replaced by new parameters on ``device``
            (default CPU) holding the checkpoint's values, keeping their plait attributes and ties; buffers
            on the meta device by zeros there (or the checkpoint's training state, ``state_buffers``).
        reader: a ``CheckpointReader`` or a checkpoint root (``tag`` picks the checkpoint).
        strict: raise if parameters are missing or checkpoint weights of this model's layers are
            unexpected; with False, load what matches and return the ``LoadReport``.
        allow_config_change: load even when the recorded config differs in a field that changes the
            computation (``check_model_config``), e.g. to change the activation on purpose.

    Returns:
        ``LoadReport`` (empty lists when everything matched).

    Raises:
        CheckpointError: a logical shape differs (names the tensor and both shapes); with
            ``strict``, missing or unexpected weights (listed); the model config differs (see above).
    """
    if not isinstance(reader, CheckpointReader):
        reader = CheckpointReader(reader, tag)
    plan, report = plan_model_load(model, reader, strict, allow_config_change)
    fill_model(model, reader, plan, device)
    return report


def plan_model_load(model: nn.Module, reader: CheckpointReader, strict: bool = True,
                    allow_config_change: bool = False) -> tuple[list, LoadReport]:
    """``load_model_weights``' checks and plan, changing nothing: the ``(param, LogicalPart)`` pairs to read
    (for ``fill_model``) and the ``LoadReport``. Raises as ``load_model_weights``."""
    if not allow_config_change:
        check_model_config(model, reader)
    plan, report = _plan_load(model, reader)
    if strict and (report.missing or report.unexpected):
        raise CheckpointError(f"checkpoint {reader.path} does not match the model: missing "
                              f"{_few(report.missing)}, unexpected {_few(report.unexpected)}; "
                              f"pass strict=False to load the rest")
    return plan, report


@torch.no_grad()
def fill_model(model: nn.Module, reader: CheckpointReader, plan: list, device=None) -> None:
    """Read ``plan`` (from ``plan_model_load``) into ``model``'s parameters, then its buffers."""
    _fill_parameters(model, reader, plan, device)
    _fill_buffers(model, reader, device)


def _fill_buffers(model: nn.Module, reader: CheckpointReader, device) -> None:
    """Buffers on the meta device become zeros on ``device`` (default CPU); training-state buffers
    (``state_buffers``) take the checkpoint's values where it holds them."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device or "cpu")
    stored = set(reader.names())
    for name, buf in state_buffers(model):
        if name in stored:
            buf.copy_(read_tp_shard(reader, name, TPShard(tuple(buf.shape)), dtype=buf.dtype, device=buf.device))


def _plan_load(model: nn.Module, reader: CheckpointReader) -> tuple[list, LoadReport]:
    """Match every parameter of ``model`` to its checkpoint tensor, checking logical shapes.

    Returns the ``(param, LogicalPart)`` pairs to read and the ``LoadReport`` of missing and unexpected
    names; changes nothing. Raises CheckpointError on the first logical shape that differs.
    """
    stored = set(reader.names())
    plan, report, wanted = [], LoadReport(), {name for name, _ in state_buffers(model)}
    for name, param in model.named_parameters():
        parts = logical_parts(checkpoint_name(name, param, model), param)
        wanted.update(part.name for part in parts)
        absent = [part.name for part in parts if part.name not in stored]
        if absent:          # a fused parameter is read whole or not at all (no half-filled rows)
            how = "" if parts[0].fused else "tied to "
            report.missing += [name if key == name else f"{name} ({how}{key})" for key in absent]
            continue
        for part in parts:
            key, spec = part.name, part.spec
            have = reader.shape(key)
            if tuple(have) != tuple(spec.logical_shape):
                raise CheckpointError(f"tensor {key!r}: the checkpoint {reader.path} has shape {list(have)}, "
                                      f"the model's parameter {name!r} expects {list(spec.logical_shape)}; "
                                      f"build the model with the checkpoint's config (meta[{MODEL_CONFIG_KEY!r}])")
            plan.append((param, part))
    report.unexpected = sorted(n for n in stored - wanted
                               if _is_model_weight(n) and not _elsewhere(n, model))
    return plan, report


def _fill_parameters(model: nn.Module, reader: CheckpointReader, plan: list, device) -> None:
    """Read each planned part's box: in place, or into a new parameter on ``device`` for one on the
    meta device (then registered wherever the old one was). Called under ``torch.no_grad``."""
    fresh = {}
    for param, part in plan:
        if not param.is_meta:
            local = part.local(param)
            local.copy_(read_tp_shard(reader, part.name, part.spec, dtype=local.dtype, device=local.device))
            continue
        if id(param) not in fresh:      # a fused parameter: allocated once, every part then read into it
            data = read_tp_shard(reader, part.name, part.spec, dtype=param.dtype, device=device) if not part.fused \
                else torch.empty(param.shape, dtype=param.dtype, device=device)
            fresh[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            fresh[id(param)].__dict__.update(param.__dict__)        # TPShard, initializer, tie marker
        if part.fused:
            local = part.local(fresh[id(param)])
            local.copy_(read_tp_shard(reader, part.name, part.spec, dtype=local.dtype, device=local.device))
    if fresh:
        _replace_parameters(model, fresh)


def _replace_parameters(model: nn.Module, fresh: dict) -> None:
    """Put ``fresh[id(old)]`` wherever ``old`` is registered (all owners of a shared parameter)."""
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) in fresh:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = fresh[id(param)]


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return f"[{shown}{more}]"
