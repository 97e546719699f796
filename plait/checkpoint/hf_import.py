"""Import: a Hugging Face model directory -> a plait checkpoint of whole logical tensors (``from_hf``).

The directory holds ``config.json`` plus ``model.safetensors`` or hub-style shards listed in
``model.safetensors.index.json``, read lazily with safetensors. The checkpoint's ``meta.json``
holds the ``TransformerConfig`` (``model_config``) and what the import saw (``hf``: model_type,
architecture, name prefix, carried config fields such as token ids, missing plait tensors and HF
tensors kept as ``hf_extra.<hf name>``, e.g. BERT's pooler, which plait has no layer for).
Pickled ``pytorch_model.bin`` files are not read (re-save them with ``safe_serialization=True``).
Runs in one process; memory peaks at the model's size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors import safe_open

from plait import untrusted
from plait.checkpoint import hf as hfmap
from plait.checkpoint.errors import CheckpointError, inside, read_json
from plait.checkpoint.model_io import EXTRA_PREFIX, MODEL_CONFIG_KEY
from plait.checkpoint.writer import CheckpointWriter, ShardItem
from plait.dtypes import cast_floating, parse_dtype
from plait.layers.config import TransformerConfig
from plait.layers.model import logical_shapes

HF_KEY = "hf"  # meta.json: what from_hf saw
HF_WEIGHTS, HF_INDEX = untrusted.HF_WEIGHTS, untrusted.HF_INDEX
HF_CONFIG = "config.json"


class HFWeights:
    """Lazy read access to the safetensors weights of a Hugging Face model directory; ``nbytes`` is the size
    of its weight files. Every file is inside ``hf_dir`` and regular (``plait.untrusted.hf_weight_files``).

    Raises:
        FileNotFoundError: neither ``model.safetensors`` nor ``model.safetensors.index.json``
            (or a shard it lists) exists in ``hf_dir``.
        CheckpointError: the index is damaged, or names a file outside ``hf_dir`` or not a regular file.
    """

    def __init__(self, hf_dir: str):
        self.dir = os.fspath(hf_dir)
        self._handles: dict[str, object] = {}
        self.file_of = untrusted.hf_weight_files(self.dir, error=CheckpointError)
        self.nbytes = sum(os.path.getsize(path) for path in set(self.file_of.values()))

    def _open(self, path: str):
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return self._handles[path]

    def names(self) -> list[str]:
        return sorted(self.file_of)

    def get(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        handle = self._open(path)
        if name not in set(handle.keys()):
            raise CheckpointError(
                f"{path} has no tensor {name!r}, though {HF_INDEX} lists it there"
            )
        return handle.get_tensor(name)


def read_hf_config(hf_dir: str) -> dict:
    """The parsed ``config.json`` of ``hf_dir``: inside the folder, regular, at most
    ``plait.untrusted.SMALL_FILE_CAP`` bytes.

    Raises:
        FileNotFoundError: no config.json (names the path).
        CheckpointError: it resolves outside ``hf_dir``, is not a regular file, too large or not a JSON object.
    """
    path = inside(os.fspath(hf_dir), HF_CONFIG, "Hugging Face config")
    try:
        raw = read_json(path, "Hugging Face config")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found: a Hugging Face model directory needs its config.json"
        ) from None
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"Hugging Face config {path} is a JSON {type(raw).__name__}, not an object"
        )
    return raw


@dataclass
class ConvertReport:
    """Outcome of ``from_hf``: where the checkpoint went and what did not map one to one."""

    path: str
    tag: str
    config: TransformerConfig
    architecture: str
    tensors: int
    missing: list[str] = field(
        default_factory=list
    )  # plait parameters with no HF tensor (keep init on load)
    extra: list[str] = field(default_factory=list)  # HF tensors kept as hf_extra.<name>
    ignored: list[str] = field(default_factory=list)  # HF buffers / tied copies not stored


def _source(rule: hfmap.Rule, hf_names: set[str]) -> tuple[tuple[str, ...], str]:
    """The HF names ``rule`` reads and their transform: its own when any of them is present, else the first
    alias with a name present (e.g. BERT's ``cls.predictions.decoder.bias``, a mixture of experts' fused
    ``experts.gate_up_proj``); ``((), kind)`` when none is."""
    for names, kind in rule.sources():
        if any(h in hf_names for h in names):
            return names, kind
    return (), rule.kind


def _rule_items(
    hf_dir: str, weights: HFWeights, rule_list: list, shapes: dict, dtype
) -> tuple[list, set]:
    """Plait ``ShardItem`` s of every rule whose HF tensors are present, and the HF names used.

    Raises:
        CheckpointError: a fused group only partly present, or a shape that disagrees with the config.
    """
    hf_names, items, used = set(weights.names()), [], set()
    for rule in rule_list:
        names, kind = _source(rule, hf_names)
        if not names:
            continue
        present = [h for h in names if h in hf_names]
        if len(present) != len(names):
            raise CheckpointError(
                f"{hf_dir}: has {present} but not {sorted(set(names) - set(present))}"
            )
        used.update(names)
        for name, tensor in zip(rule.plait, hfmap.to_plait(kind, [weights.get(h) for h in names])):
            if tuple(tensor.shape) != shapes[name]:
                raise CheckpointError(
                    f"{hf_dir}: {names} gives plait tensor {name!r} shape "
                    f"{list(tensor.shape)}, but config.json implies {list(shapes[name])}"
                )
            items.append(ShardItem.whole(name, cast_floating(tensor, dtype)))
    return items, used


def from_hf(
    hf_dir: str,
    out_root: str,
    tag: str = "hf",
    dtype: str | torch.dtype | None = None,
    max_file_bytes: int | None = None,
) -> ConvertReport:
    """Convert the Hugging Face model in ``hf_dir`` into the plait checkpoint ``<out_root>/<tag>``.

    Args:
        hf_dir: directory with ``config.json`` and safetensors weights (single or sharded).
        out_root: plait checkpoint root (``latest`` is pointed at ``tag``).
        dtype: cast floating tensors (default: keep the stored dtype).
        max_file_bytes: split the checkpoint's file at this size.

    Returns:
        ``ConvertReport``; ``missing`` lists plait parameters without an HF tensor (e.g. the MLM
        head of a plain ``BertModel``), which ``load_model_weights(strict=False)`` leaves at init.

    Raises:
        ValueError: unsupported model_type or architecture feature; a size in config.json that is not a
            positive whole number, or one implying more weights than the folder's files hold (names the key).
        CheckpointError: a tensor's shape disagrees with the config (names both), a fused tensor is only
            partly present, or a file the folder names resolves outside it or is not a regular file.
        RuntimeError: called inside a multi-process ``torch.distributed`` job (run it in one process).
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "from_hf runs in one process; call it before torch.distributed is initialized "
            "or use the `plait convert from-hf` command"
        )
    dtype = parse_dtype(dtype)
    raw, weights = _open_source(hf_dir)
    config = hfmap.config_from_hf(raw)
    layout = hfmap.detect_layout(raw["model_type"], weights.names())
    shapes = logical_shapes(config)
    rule_list = hfmap.rules(config, layout)
    items, used = _rule_items(hf_dir, weights, rule_list, shapes, dtype)
    ignored, extra = _leftovers(sorted(set(weights.names()) - used), rule_list, config)
    items += [
        ShardItem.whole(EXTRA_PREFIX + n, cast_floating(weights.get(n), dtype)) for n in extra
    ]
    missing = sorted(set(shapes) - {it.name for it in items})
    meta = {
        MODEL_CONFIG_KEY: config.to_dict(),
        HF_KEY: _import_meta(raw, layout, hf_dir, missing, extra),
    }
    CheckpointWriter(out_root, max_file_bytes=max_file_bytes).save(tag, items, meta)
    return ConvertReport(
        os.path.join(os.fspath(out_root), tag),
        tag,
        config,
        layout.architecture,
        len(items),
        missing,
        extra,
        ignored,
    )


def _open_source(hf_dir: str) -> tuple[dict, HFWeights]:
    """``config.json`` and the weights of ``hf_dir``, checked before any tensor is read: a known model type,
    and sizes the files can hold (``check_hf_sizes``)."""
    raw = read_hf_config(hf_dir)
    hfmap.check_model_type(raw.get("model_type"))
    weights = HFWeights(hf_dir)
    hfmap.check_hf_sizes(raw, os.path.join(os.fspath(hf_dir), HF_CONFIG), weights.nbytes)
    return raw, weights


def _leftovers(leftover: list[str], rule_list: list, config) -> tuple[list[str], list[str]]:
    """The HF tensors no rule read, as (ignored: aliases and names plait drops on purpose, extra: kept
    under ``hf_extra.`` for export)."""
    aliases = hfmap.alias_names(rule_list)
    ignored = [n for n in leftover if n in aliases or hfmap.ignored_hf_name(n, config)]
    extra = [n for n in leftover if n not in set(ignored)]
    return ignored, extra


def _import_meta(raw: dict, layout, hf_dir: str, missing: list[str], extra: list[str]) -> dict:
    """``meta.json[HF_KEY]``: what ``from_hf`` saw (model type, class, prefix, source folder, the HF config
    fields plait carries for export, missing and extra tensors)."""
    return {
        "model_type": layout.model_type,
        "architecture": layout.architecture,
        "prefix": layout.prefix,
        "source": os.path.abspath(hf_dir),
        "config": {k: raw[k] for k in hfmap.CARRIED_FIELDS if k in raw},
        "missing": missing,
        "extra": extra,
    }
