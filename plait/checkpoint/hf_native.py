"""Hugging Face models trained as they are (``plait.initialize(transformers_model)``, ``plait.hf.Trainer``):
their checkpoints hold the model's own parameter names, so the way back to a Hugging Face directory is those
names in safetensors plus the model's ``config.json``.

``hf_model_meta(model)`` is what a save records under :data:`HF_MODEL_KEY` (the class and its config);
``native_jobs`` checks a checkpoint's names against that class (built on the meta device, no memory) and
lists the tensors to write; ``write_config`` writes ``config.json``. ``to_hf`` calls them for such a
checkpoint (it has no plait ``model_config``).
"""

from __future__ import annotations

import json
import os

import torch

from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.index import OPTIMIZER_PREFIX

#: ``meta.json`` key: ``{"architecture": "GPT2LMHeadModel", "config": PretrainedConfig.to_dict()}``.
HF_MODEL_KEY = "hf_model"


def hf_model_meta(model) -> dict | None:
    """What a checkpoint of a transformers model needs for export: its class name and full config (config.json's dict);
    None for any other module (plait's own models record a ``TransformerConfig`` instead)."""
    config = getattr(model, "config", None)
    if not (
        hasattr(config, "model_type")
        and hasattr(config, "to_json_string")
        and hasattr(model, "base_model_prefix")
    ):
        return None
    return {
        "architecture": type(model).__name__,
        "config": json.loads(config.to_json_string(use_diff=False)),
    }


def native_config(meta: dict, hf_config: dict | None, where: str) -> dict:
    """The config dict to export with: ``hf_config`` (a parsed config.json, ``--hf-config``) else the saved one.

    Raises:
        CheckpointError: neither is there (a checkpoint saved before plait recorded it).
    """
    config = hf_config or (meta.get(HF_MODEL_KEY) or {}).get("config")
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(
            f"{where}: meta.json has neither a plait 'model_config' nor a Hugging Face "
            f"{HF_MODEL_KEY!r} config; pass the model's original config.json "
            f"(plait convert to-hf --hf-config PATH, or to_hf(hf_config=...))"
        )
    if not config.get("architectures"):
        arch = (meta.get(HF_MODEL_KEY) or {}).get("architecture")
        config = {**config, "architectures": [arch]} if arch else config
    return config


def native_jobs(names: list[str], config: dict) -> tuple[str, list[str], list[str]]:
    """``(architecture, names to write, parameters missing)`` for a checkpoint of the model ``config``
    describes (its ``architectures`` entry, else the causal-LM, masked-LM or base class of its
    ``model_type`` whose names cover the checkpoint's).

    Raises:
        CheckpointError: no such class, or checkpoint tensors the class does not have (names a few).
    """
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "transformers_version"}
    )
    weights = [n for n in names if not n.startswith(OPTIMIZER_PREFIX)]
    foreign = []
    for arch in _candidates(transformers, config):
        with torch.device("meta"):
            model = getattr(transformers, arch)(hf_cfg)
        known = set(model.state_dict())
        foreign = [n for n in weights if n not in known]
        if not foreign:
            return (
                arch,
                weights,
                sorted(n for n, _ in model.named_parameters() if n not in set(weights)),
            )
    if not foreign:
        raise CheckpointError(
            f"config model_type {config.get('model_type')!r} names no transformers model class; "
            f"set 'architectures' in the config.json passed as --hf-config"
        )
    raise CheckpointError(
        f"{len(foreign)} checkpoint tensors are not parameters of {arch}, e.g. {foreign[:3]}: "
        f"pass the config.json of the model that was trained (--hf-config)"
    )


def _candidates(transformers, config: dict) -> list[str]:
    if config.get("architectures"):
        return [a for a in config["architectures"][:1] if hasattr(transformers, a)]
    from transformers.models.auto import modeling_auto as auto

    tables = (
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        auto.MODEL_MAPPING_NAMES,
    )
    names = [table.get(config.get("model_type")) for table in tables]
    return [n for n in names if isinstance(n, str) and hasattr(transformers, n)]


def write_config(config: dict, out_dir: str, dtype: torch.dtype) -> None:
    """``config.json`` in ``out_dir``: ``config`` with its dtype entry set to ``dtype``."""
    out = {k: v for k, v in config.items()}
    key = "dtype" if "dtype" in out or "torch_dtype" not in out else "torch_dtype"
    out[key] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2, sort_keys=True)
