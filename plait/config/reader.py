"""Read a DeepSpeed-style JSON config: check every key and value type, then resolve and build.

Keys are checked against the dataclasses in :mod:`plait.config.schema`. An unknown key raises
:class:`ConfigError` naming the key, its section and the closest valid key (``difflib``); a DeepSpeed key
plait does not implement raises :class:`UnsupportedConfigError` (see :mod:`plait.config.unsupported`);
a value of the wrong type names the key and the expected type (:mod:`plait.config.coerce`). ``"auto"`` is
kept for the fields that allow it and resolved in :mod:`plait.config.resolve`; a field typed with
``Literal["auto"]`` (``device_step_fraction``) keeps it as its value (``schema_base.takes_auto``).
"""

from __future__ import annotations

import difflib
import json
import os
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any
from collections.abc import Mapping

from plait.config.accepted import check_accepted, log
from plait.config.coerce import coerce, describe, strip_optional
from plait.config.resolve import build_config, resolve_auto
from plait.config.schema import (
    AUTO,
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
    ConfigError,
    OptimizerConfig,
    PlaitConfig,
    SchedulerConfig,
)
from plait.config.schema_base import takes_auto
from plait.config.unsupported import (
    UNSUPPORTED_OPTIMIZERS,
    UNSUPPORTED_SCHEDULERS,
    UnsupportedConfigError,
    check_unsupported,
    check_unsupported_value,
)


def load_config(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    dp_size: int | None = None,
    world_size: int | None = None,
    model_hidden_size: int | None = None,
    micro_batch_size: int | None = None,
    gradient_accumulation_steps: int | None = None,
    train_batch_size: int | None = None,
    mixed_precision: str | None = None,
    gradient_clipping: float | None = None,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    warmup_min_lr: float | None = None,
    warmup_num_steps: int | None = None,
    total_num_steps: int | None = None,
) -> PlaitConfig:
    """Read a ds_config (path to a JSON file, or a dict) into a resolved, validated, frozen
    :class:`PlaitConfig` (``cfg.to_dict()`` loads back to an equal config).

    Args:
        source: path of a JSON file or an already-parsed dict (not modified).
        dp_size, world_size: data-parallel size, or all ranks (``dp = world_size / (tensor_parallel.size x
            pipeline.size x context_parallel.size)``); needed to derive a missing member of
            ``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp``.
        model_hidden_size: hidden size h, for the ZeRO "auto" bucket sizes.
        mixed_precision: "fp16", "bf16", "fp32" or None: resolves ``fp16.enabled``/``bf16.enabled`` "auto".
        micro_batch_size, gradient_accumulation_steps, train_batch_size: values for those keys when "auto".
        gradient_clipping, lr, betas, eps, weight_decay, warmup_min_lr, warmup_num_steps, total_num_steps:
            the same, Hugging Face Trainer style (the rules: :mod:`plait.config.resolve`).

    Raises:
        ConfigError (a ValueError), naming the key and the fix: an unknown key, a wrong type, batch sizes
            that do not multiply out, "auto" without the fact it needs, contradicting sections, a number out
            of range (the list: ``docs/config.md``, "Errors").
        UnsupportedConfigError (a ConfigError): a DeepSpeed feature plait does not implement.
        FileNotFoundError: ``source`` path does not exist.
    """
    raw = read_raw(_load_json(source))
    resolved = resolve_auto(
        raw,
        dp_size=dp_size,
        world_size=world_size,
        hidden=model_hidden_size,
        micro=micro_batch_size,
        gas=gradient_accumulation_steps,
        train=train_batch_size,
        mixed_precision=mixed_precision,
        gradient_clipping=gradient_clipping,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        warmup_min_lr=warmup_min_lr,
        warmup_num_steps=warmup_num_steps,
        total_num_steps=total_num_steps,
    )
    return build_config(resolved)


def _load_json(source: Any) -> dict:
    if isinstance(source, Mapping):
        try:
            return json.loads(json.dumps(source))  # deep copy; also rejects non-JSON values early
        except (TypeError, ValueError) as err:
            raise ConfigError(
                f"config dict must hold only JSON values (dict, list, str, number, bool, "
                f"null): {err}"
            ) from None
    path = os.fspath(source)
    with open(path, encoding="utf-8") as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err}") from None


def read_raw(data: Any) -> dict:
    """Check keys and value types of a parsed ds_config; return the present keys as a nested dict with
    values coerced (ints from integral floats like ``2e8``, tuples for betas) and "auto" kept as "auto"."""
    return _read_section(data, PlaitConfig, "")


# ---------------------------------------------------------------------------------------------- sections
def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _name(section: str) -> str:
    return f"'{section}'" if section else "config"


def _keys(cls: type) -> tuple:
    """(json key -> field, type hints) for a section dataclass; aliases map to their field."""
    by_key = {}
    for f in fields(cls):
        by_key[f.name] = f
        for alias in f.metadata.get("aliases", ()):
            by_key[alias] = f
    return types.MappingProxyType(by_key), types.MappingProxyType(typing.get_type_hints(cls))


def _read_section(data: Any, cls: type, section: str) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{_name(section)} must be a JSON object, got {type(data).__name__} {data!r}"
        )
    by_key, hints = _keys(cls)
    if section == "zero_optimization":
        data = _legacy_offload(data)
    out: dict = {}
    for key, value in data.items():
        key = str(key)
        f = by_key.get(key)
        if f is None:
            if check_accepted(section, key, value) or check_unsupported(section, key, value):
                continue
            if section == "" and _ignored_top_level(key, [f.name for f in fields(cls)]):
                continue
            raise _unknown_key(key, section, [f.name for f in fields(cls)])
        if f.name in out:
            raise ConfigError(
                f"{_name(section)} sets '{f.name}' twice (as '{f.name}' and an alias); keep one"
            )
        if f.name == "communication_data_type" and isinstance(value, str):
            value = {"bfp16": "bf16"}.get(
                value.lower(), value.lower()
            )  # DeepSpeed < 0.10 spelled it bfp16
        out[f.name] = _read_value(value, hints[f.name], f, section, key)
    return out


#: DeepSpeed's older zero_optimization spellings -> (section, key) they set (DeepSpeed translates them too)
_LEGACY_OFFLOAD = types.MappingProxyType(
    {
        "cpu_offload": ("offload_optimizer", "device"),
        "cpu_offload_param": ("offload_param", "device"),
        "cpu_offload_params": ("offload_param", "device"),
        "cpu_offload_use_pin_memory": ("offload_optimizer", "pin_memory"),
    }
)


def _legacy_offload(data: dict) -> dict:
    """``cpu_offload: true`` and friends rewritten as ``offload_optimizer``/``offload_param`` settings.

    Raises:
        ConfigError: both spellings of one setting are given.
    """
    data = dict(data)
    for old, (sub, key) in _LEGACY_OFFLOAD.items():
        if old not in data:
            continue
        value = data.pop(old)
        if not isinstance(value, bool):
            raise ConfigError(
                f"'zero_optimization.{old}' must be a boolean (true/false), got {value!r}"
            )
        if key == "device":
            value = "cpu" if value else "none"
        section = dict(data.get(sub) or {})
        if key in section and section[key] != value:
            raise ConfigError(
                f"zero_optimization sets {old} and {sub}.{key} differently; keep {sub}.{key}"
            )
        section[key] = value
        data[sub] = section
    return data


def _ignored_top_level(key: str, valid: list) -> bool:
    """A top-level key DeepSpeed does not read either: ``_comment``-style keys silently, any other key that
    is not a near-miss of a valid one with a notice (DeepSpeed ignores unknown top-level keys). A near-miss
    (``gradient_acumulation_steps``) is not ignored: it is an error naming the valid key."""
    if key.startswith("_"):
        return True
    if difflib.get_close_matches(key, valid, n=1, cutoff=0.6) or _sections_with_key(key):
        return False
    log.warning("config: top-level key '%s' is not read by plait or DeepSpeed; ignored", key)
    return True


def _unknown_key(key: str, section: str, valid: list) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean '{close[0]}'?"
    else:
        homes = [s for s in _sections_with_key(key) if s != section]
        hint = (
            f"'{key}' belongs in {_name(homes[0])}"
            if homes
            else "valid keys: " + ", ".join(sorted(valid))
        )
    return ConfigError(f"unknown key '{key}' in {_name(section)}; {hint}")


def _sections_with_key(key: str, cls: type = PlaitConfig, section: str = "") -> list:
    found = []
    by_key, hints = _keys(cls)
    if key in by_key:
        found.append(section)
    for f in fields(cls):
        sub = strip_optional(hints[f.name])
        if is_dataclass(sub) and sub not in (OptimizerConfig, SchedulerConfig):
            found += _sections_with_key(key, sub, _join(section, f.name))
    return found


def _read_value(value: Any, hint: Any, f: Any, section: str, key: str) -> Any:
    path, written = (
        _join(section, f.name),
        _join(section, key),
    )  # messages name the key as the user wrote it
    if isinstance(value, str) and value == AUTO and not takes_auto(hint):
        if f.metadata.get("auto"):
            return AUTO
        raise ConfigError(f"'{written}' does not accept \"auto\"; write {describe(hint)}")
    check_unsupported_value(section, key, value)
    inner = strip_optional(hint)
    if inner is OptimizerConfig:
        return (
            None
            if value is None
            else _read_typed(value, path, OPTIMIZER_PARAMS, UNSUPPORTED_OPTIMIZERS)
        )
    if inner is SchedulerConfig:
        return (
            None
            if value is None
            else _read_typed(value, path, SCHEDULER_PARAMS, UNSUPPORTED_SCHEDULERS)
        )
    if is_dataclass(inner):
        return _read_section(
            value, inner, path if isinstance(value, dict) else written
        )  # keys: canonical section
    return coerce(value, hint, written)


def _read_typed(data: Any, section: str, registry: Mapping, unsupported: frozenset) -> dict:
    """``optimizer`` / ``scheduler``: {"type": name, "params": {...}} with per-type params."""
    if not isinstance(data, dict):
        raise ConfigError(
            f'\'{section}\' must be a JSON object with "type" and "params", got {data!r}'
        )
    for key in data:
        if key not in ("type", "params") and not (
            check_accepted(section, key, data[key]) or check_unsupported(section, key, data[key])
        ):
            raise _unknown_key(key, section, ["type", "params"])
    name = data.get("type")
    if not isinstance(name, str):
        raise ConfigError(
            f"'{section}.type' must be a string, one of {', '.join(registry)}; got {name!r}"
        )
    canonical = {k.lower(): k for k in registry}.get(name.lower())
    if canonical is None:
        if name.lower() in {u.lower() for u in unsupported}:
            raise UnsupportedConfigError(
                f"plait does not implement {section} type '{name}'; use one of "
                f"{', '.join(registry)}"
            )
        close = difflib.get_close_matches(
            name.lower(), [k.lower() for k in registry], n=1, cutoff=0.6
        )
        hint = f"; did you mean '{ {k.lower(): k for k in registry}[close[0]] }'?" if close else ""
        raise ConfigError(
            f"unknown {section} type '{name}'{hint} (supported: {', '.join(registry)})"
        )
    params = _read_section(data.get("params", {}), registry[canonical], f"{section}.params")
    if canonical == "AdamW" and params.get("adam_w_mode") is False:
        raise ConfigError(
            "optimizer type 'AdamW' with params.adam_w_mode false is contradictory; use type "
            "'Adam' with adam_w_mode false for L2-regularised Adam"
        )
    return {"type": canonical, "params": params}
