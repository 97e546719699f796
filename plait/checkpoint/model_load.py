"""Load a model's weights in any tensor/pipeline/data-parallel layout from a checkpoint of any layout.

``load_model_weights`` fills every local parameter from any saved layout, reading only this rank's box of each
tensor (``read_tp_shard``); vocabulary padding rows are zero-filled. It runs in two steps that
``checkpoint/engine_io.py`` also calls: ``plan_model_load`` checks names, shapes and the recorded model config
and changes nothing; ``fill_model`` then reads into the parameters and buffers. Names starting with
``model_io.EXTRA_PREFIX`` (kept only for Hugging Face export) or ``optimizer.`` are not model weights and are
ignored.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.index import OPTIMIZER_PREFIX
from plait.checkpoint.model_io import EXTRA_PREFIX, MODEL_CONFIG_KEY, checkpoint_name, state_buffers
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.tp import read_tp_shard
from plait.layers.config import TransformerConfig
from plait.parallel.sharding import TPShard, logical_parts

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
COMPUTE_FIELDS = (
    "arch",
    "num_heads",
    "num_kv_heads",
    "activation",
    "norm",
    "norm_eps",
    "rope_theta",
    "tie_embeddings",
    "causal",
    "post_norm",
    "qk_norm",
    "moe_top_k",
    "moe_router_order",
    "moe_normalize_topk",
)


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
    diff = [
        f"{k}: checkpoint {saved[k]!r}, model {mine[k]!r}"
        for k in COMPUTE_FIELDS
        if k in saved and saved[k] != mine.get(k)
    ]
    if diff:
        raise CheckpointError(
            f"checkpoint {reader.path} was saved from a model that computes differently ("
            + "; ".join(diff)
            + "): build the model with the checkpoint's config "
            f"(meta[{MODEL_CONFIG_KEY!r}]), or pass allow_config_change=True to load it anyway"
        )


@torch.no_grad()
def load_model_weights(
    model: nn.Module,
    reader: CheckpointReader | str | os.PathLike,
    strict: bool = True,
    tag: str | None = None,
    device=None,
    allow_config_change: bool = False,
) -> LoadReport:
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


def plan_model_load(
    model: nn.Module,
    reader: CheckpointReader,
    strict: bool = True,
    allow_config_change: bool = False,
) -> tuple[list, LoadReport]:
    """``load_model_weights``' checks and plan, changing nothing: the ``(param, LogicalPart)`` pairs to read
    (for ``fill_model``) and the ``LoadReport``. Raises as ``load_model_weights``."""
    if not allow_config_change:
        check_model_config(model, reader)
    plan, report = _plan_load(model, reader)
    if strict and (report.missing or report.unexpected):
        raise CheckpointError(
            f"checkpoint {reader.path} does not match the model: missing "
            f"{_few(report.missing)}, unexpected {_few(report.unexpected)}; "
            f"pass strict=False to load the rest"
        )
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
                module._buffers[name] = torch.zeros(
                    buf.shape, dtype=buf.dtype, device=device or "cpu"
                )
    stored = set(reader.names())
    for name, buf in state_buffers(model):
        if name in stored:
            buf.copy_(
                read_tp_shard(
                    reader, name, TPShard(tuple(buf.shape)), dtype=buf.dtype, device=buf.device
                )
            )


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
        if absent:  # a fused parameter is read whole or not at all (no half-filled rows)
            how = "" if parts[0].fused else "tied to "
            report.missing += [name if key == name else f"{name} ({how}{key})" for key in absent]
            continue
        for part in parts:
            key, spec = part.name, part.spec
            have = reader.shape(key)
            if tuple(have) != tuple(spec.logical_shape):
                raise CheckpointError(
                    f"tensor {key!r}: the checkpoint {reader.path} has shape {list(have)}, "
                    f"the model's parameter {name!r} expects {list(spec.logical_shape)}; "
                    f"build the model with the checkpoint's config (meta[{MODEL_CONFIG_KEY!r}])"
                )
            plan.append((param, part))
    report.unexpected = sorted(
        n for n in stored - wanted if _is_model_weight(n) and not _elsewhere(n, model)
    )
    return plan, report


def _fill_parameters(model: nn.Module, reader: CheckpointReader, plan: list, device) -> None:
    """Read each planned part's box: in place, or into a new parameter on ``device`` for one on the
    meta device (then registered wherever the old one was). Called under ``torch.no_grad``."""
    fresh = {}
    for param, part in plan:
        if not param.is_meta:
            local = part.local(param)
            local.copy_(
                read_tp_shard(reader, part.name, part.spec, dtype=local.dtype, device=local.device)
            )
            continue
        if (
            id(param) not in fresh
        ):  # a fused parameter: allocated once, every part then read into it
            data = (
                read_tp_shard(reader, part.name, part.spec, dtype=param.dtype, device=device)
                if not part.fused
                else torch.empty(param.shape, dtype=param.dtype, device=device)
            )
            fresh[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            fresh[id(param)].__dict__.update(param.__dict__)  # TPShard, initializer, tie marker
        if part.fused:
            local = part.local(fresh[id(param)])
            local.copy_(
                read_tp_shard(reader, part.name, part.spec, dtype=local.dtype, device=local.device)
            )
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
