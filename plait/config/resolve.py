"""Resolve "auto" values and the batch-size triple, then build the frozen :class:`PlaitConfig`.

``resolve_auto`` fills each "auto" key from the facts given to :func:`plait.config.load_config`
(``lr``, ``micro_batch_size``, ``mixed_precision``, ``model_hidden_size``, ...) as the Hugging Face
Trainer's DeepSpeed integration fills them from its arguments; a required fact that is missing (``lr``,
``warmup_num_steps``, ``total_num_steps``, ``model_hidden_size`` for bucket sizes) raises ``ConfigError``
naming the key. ``bucket_sizes`` gives the ZeRO buckets of hidden size h (``h*h``, ``int(0.9*h*h)``,
``10*h``). ``build_config`` applies DeepSpeed's batch rule ``train_batch_size =
train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp`` (two given: the third derived; all
three: checked) and checks bounds. ``device_step_fraction: "auto"`` is that key's own value, kept as
written. Every rule, one per key: ``docs/config.md``.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, asdict, fields, is_dataclass
from typing import Any

from plait.config.coerce import strip_optional
from plait.config.schema import (
    AUTO,
    OPTIMIZER_PARAMS,
    REQUIRED_PARAMS,
    SCHEDULER_PARAMS,
    ConfigError,
    OptimizerConfig,
    PlaitConfig,
    SchedulerConfig,
    ZeroConfig,
)
from plait.config.schema_base import INT_LIMIT, check_number, takes_auto

_TRIPLE = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def field_default(cls: type, name: str) -> Any:
    """Default value of field ``name`` of dataclass ``cls``."""
    for f in fields(cls):
        if f.name == name:
            return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    raise KeyError(name)


def _need(value: Any, key: str, fact: str) -> Any:
    if value is None:
        raise ConfigError(
            f"'{key}' is \"auto\" but nothing resolves it; pass {fact}=... to plait.initialize "
            "(or load_config), or write a number in the config"
        )
    return value


BUCKET_KEYS = (
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)


def bucket_sizes(hidden: int) -> dict[str, int]:
    """The ZeRO bucket sizes "auto" means for a model of hidden size ``hidden`` (elements; the rules of
    transformers' and accelerate's DeepSpeed integrations), keyed by ``BUCKET_KEYS``."""
    return {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }


def resolve_auto(
    raw: dict,
    *,
    dp_size: int | None,
    world_size: int | None,
    hidden: int | None,
    micro: int | None,
    gas: int | None,
    train: int | None,
    mixed_precision: str | None,
    gradient_clipping: float | None,
    lr: float | None,
    betas: Any,
    eps: float | None,
    weight_decay: float | None,
    warmup_min_lr: float | None,
    warmup_num_steps: int | None,
    total_num_steps: int | None,
) -> dict:
    """Return a copy of the checked ``raw`` dict (from ``read_raw``) with every "auto" replaced and the
    batch triple complete, following the table in ``docs/config.md``. Raises ConfigError."""
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    _resolve_precision(cfg, mixed_precision, gradient_clipping)
    opt_lr = _resolve_optimizer(cfg, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    max_lr = lr if lr is not None else opt_lr
    _resolve_scheduler(cfg, max_lr, warmup_min_lr, warmup_num_steps, total_num_steps)
    _resolve_zero(cfg, hidden)
    _resolve_batch(cfg, dp_size=dp_size, world_size=world_size, facts=(train, micro, gas))
    _check_no_auto(cfg, "")
    return cfg


def _resolve_precision(
    cfg: dict, mixed_precision: str | None, gradient_clipping: float | None
) -> None:
    """``fp16.enabled`` / ``bf16.enabled`` from ``mixed_precision``; ``gradient_clipping`` (default 1.0)."""
    if mixed_precision not in (None, "fp16", "bf16", "fp32"):
        raise ConfigError(
            f"mixed_precision must be 'fp16', 'bf16', 'fp32' or None, got {mixed_precision!r}"
        )
    for section in ("fp16", "bf16"):
        if cfg.get(section, {}).get("enabled") == AUTO:
            cfg[section]["enabled"] = mixed_precision == section
    if cfg.get("gradient_clipping") == AUTO:
        cfg["gradient_clipping"] = 1.0 if gradient_clipping is None else float(gradient_clipping)


def _resolve_optimizer(cfg: dict, *, lr, betas, eps, weight_decay) -> float | None:
    """``optimizer.params`` "auto" values from the facts (else the type's defaults; ``lr`` has none).
    Returns the optimizer's learning rate (None without an ``optimizer`` section)."""
    if not cfg.get("optimizer"):
        return None
    opt = cfg["optimizer"] = {
        "type": cfg["optimizer"]["type"],
        "params": dict(cfg["optimizer"]["params"]),
    }
    cls = OPTIMIZER_PARAMS[opt["type"]]
    facts = {
        "lr": lr,
        "betas": None if betas is None else tuple(betas),
        "eps": eps,
        "weight_decay": weight_decay,
    }
    if opt["params"].get("lr") == AUTO:  # no default: the Trainer's is 5e-5, torch's AdamW's 1e-3
        opt["params"]["lr"] = _need(lr, "optimizer.params.lr", "lr")
    for key, fact in facts.items():
        if opt["params"].get(key) == AUTO:
            opt["params"][key] = fact if fact is not None else field_default(cls, key)
    return opt["params"].get("lr", field_default(cls, "lr"))


def _resolve_scheduler(
    cfg: dict,
    max_lr: float | None,
    warmup_min_lr: float | None,
    warmup_num_steps: int | None,
    total_num_steps: int | None,
) -> None:
    """``scheduler.params`` "auto" values; ``max_lr``: the ``lr`` fact, else the optimizer's."""
    if not cfg.get("scheduler"):
        return
    sch = cfg["scheduler"] = {
        "type": cfg["scheduler"]["type"],
        "params": dict(cfg["scheduler"]["params"]),
    }
    p, where = sch["params"], "scheduler.params."
    if p.get("warmup_min_lr") == AUTO:
        p["warmup_min_lr"] = 0.0 if warmup_min_lr is None else float(warmup_min_lr)
    if p.get("warmup_max_lr") == AUTO:
        p["warmup_max_lr"] = float(_need(max_lr, where + "warmup_max_lr", "lr"))
    if p.get("warmup_num_steps") == AUTO:
        p["warmup_num_steps"] = _need(
            warmup_num_steps, where + "warmup_num_steps", "warmup_num_steps"
        )
    if p.get("total_num_steps") == AUTO:
        p["total_num_steps"] = _need(total_num_steps, where + "total_num_steps", "total_num_steps")


def _resolve_zero(cfg: dict, hidden: int | None) -> None:
    """``zero_optimization`` "auto" values: bucket sizes from the hidden size, DeepSpeed's defaults else."""
    zero = cfg.get("zero_optimization", {})
    for key in BUCKET_KEYS:
        if zero.get(key) == AUTO:
            zero[key] = bucket_sizes(
                _need(hidden, f"zero_optimization.{key}", "model_hidden_size")
            )[key]
    for key in (
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
    ):  # memory knobs: DeepSpeed's default
        if zero.get(key) == AUTO:
            zero[key] = field_default(ZeroConfig, key)
    if zero.get("stage3_gather_16bit_weights_on_model_save") == AUTO:
        zero["stage3_gather_16bit_weights_on_model_save"] = False


def _dp(cfg: dict, dp_size: int | None, world_size: int | None) -> int | None:
    tp = cfg.get("tensor_parallel", {}).get("size", 1)
    pp = cfg.get("pipeline", {}).get("size", 1)
    cp = cfg.get("context_parallel", {}).get("size", 1)
    for name, value in (("dp_size", dp_size), ("world_size", world_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if world_size is None:
        return dp_size
    split = tp * pp * cp
    if world_size % split != 0:
        raise ConfigError(
            f"world_size ({world_size}) is not divisible by tensor_parallel.size ({tp}) x "
            f"pipeline.size ({pp}) x context_parallel.size ({cp}); launch a multiple of {split} "
            "ranks or change tp/pp/cp"
        )
    derived = world_size // split
    if dp_size is not None and dp_size != derived:
        raise ConfigError(
            f"dp_size ({dp_size}) != world_size ({world_size}) / (tp {tp} x pp {pp} x cp {cp}) = "
            f"{derived}; pass one of them or make them agree"
        )
    return derived


def _resolve_batch(cfg: dict, *, dp_size: int | None, world_size: int | None, facts: tuple) -> None:
    """The batch triple completed in ``cfg`` (DeepSpeed's rule, module docstring); ``facts``: the caller's
    (train, micro, gas) for "auto". ``pipeline.micro_batches`` is the accumulation when that is unset."""
    dp = _dp(cfg, dp_size, world_size)
    mb = cfg.get("pipeline", {}).get("micro_batches")
    if mb is not None and cfg.get("gradient_accumulation_steps") in (None, AUTO):
        cfg["gradient_accumulation_steps"] = mb
    train, micro, gas = _complete_triple(*_given_triple(cfg, facts), dp)
    cfg.update(zip(_TRIPLE, (train, micro, gas)))
    pipe = cfg.get("pipeline")
    if pipe is not None and (pipe.get("size", 1) > 1 or "micro_batches" in pipe):
        cfg["pipeline"] = {**pipe, "micro_batches": pipe.get("micro_batches", gas)}


def _given_triple(cfg: dict, facts: tuple) -> tuple:
    """(train, micro, gas) as written, "auto" taking the caller's fact; None where unknown."""
    # no batch size at all (the Hugging Face test configs): the caller's facts, as for "auto"
    none_given = all(cfg.get(key) is None for key in _TRIPLE[:2])
    vals = {}
    for key, fact in zip(_TRIPLE, facts):
        v = cfg.get(key)
        vals[key] = fact if v == AUTO or (v is None and none_given) else v
    for key, v in vals.items():
        if v is not None and (not isinstance(v, int) or not 1 <= v < INT_LIMIT):
            raise ConfigError(f"{key} must be a positive integer below 2**63, got {v!r}")
    return tuple(vals[k] for k in _TRIPLE)


def _complete_triple(
    train: int | None, micro: int | None, gas: int | None, dp: int | None
) -> tuple:
    """(train, micro, gas): all three checked against ``train = micro x gas x dp``, or the missing one
    derived. Raises ConfigError naming all four numbers."""
    dp_text = "the data-parallel size" if dp is None else f"dp ({dp})"

    def show(v: int | None) -> object:
        return "missing" if v is None else v

    numbers = (
        f"train_batch_size ({show(train)}), train_micro_batch_size_per_gpu ({show(micro)}), "
        f"gradient_accumulation_steps ({show(gas)}), {dp_text}"
    )
    fix = (
        "train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp; "
        'change one, or set it to "auto" to derive it'
    )

    if train is None and micro is None:
        raise ConfigError(
            f"set train_batch_size or train_micro_batch_size_per_gpu (both missing or unresolved "
            f'"auto"); {numbers}'
        )
    if gas is None and (train is None or micro is None):
        gas = 1  # DeepSpeed: only one of train / micro given -> no accumulation
    if train is not None and micro is not None and gas is not None:
        if dp is not None and train != micro * gas * dp:
            raise ConfigError(
                f"inconsistent batch sizes: {numbers}: {micro} x {gas} x {dp} = {micro * gas * dp} "
                f"!= {train}; {fix}"
            )
        if train % (micro * gas) != 0:
            raise ConfigError(
                f"inconsistent batch sizes: {numbers}: {train} is not a multiple of {micro} x "
                f"{gas}; {fix}"
            )
        return train, micro, gas
    if dp is None:
        raise ConfigError(
            f"cannot complete the batch sizes without the data-parallel size: {numbers}; pass "
            "dp_size= (or world_size=) to load_config, or give all three batch keys"
        )
    if train is None:
        return micro * gas * dp, micro, gas
    if gas is None:
        known, missing = micro, "gradient_accumulation_steps"
    else:
        known, missing = gas, "train_micro_batch_size_per_gpu"
    if train % (known * dp) != 0:
        raise ConfigError(
            f"cannot derive {missing}: {numbers}: {train} is not divisible by {known} x {dp}; {fix}"
        )
    if gas is None:
        return train, micro, train // (micro * dp)
    return train, train // (gas * dp), gas


def _check_no_auto(value: Any, path: str, cls: Any = PlaitConfig) -> None:
    """No "auto" placeholder is left in ``value`` (the section of dataclass ``cls``); a key whose type takes
    "auto" as a value of its own (``takes_auto``: ``device_step_fraction``) keeps it."""
    if value == AUTO:
        raise ConfigError(f"'{path}' is \"auto\" and no rule resolves it")  # schema/rule mismatch
    if isinstance(value, dict):
        hints = typing.get_type_hints(cls) if is_dataclass(cls) else {}
        for k, v in value.items():
            hint = hints.get(k)
            if hint is None or not takes_auto(hint):
                _check_no_auto(
                    v,
                    f"{path}.{k}" if path else k,
                    strip_optional(hint) if hint is not None else None,
                )


# ------------------------------------------------------------------------------------------------- build
def build_config(cfg: dict) -> PlaitConfig:
    """Construct the frozen dataclasses from a resolved dict; defaults fill absent keys. Every value given
    passes :func:`check_number` with its field's ``bounds`` first (ConfigError naming the key)."""
    return _build(PlaitConfig, cfg, "")


def _build(cls: type, data: dict, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    _check_numbers(cls, data, path)
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value, hint, where = data[f.name], hints[f.name], f"{path}.{f.name}" if path else f.name
        inner = strip_optional(hint)
        if value is None:
            kwargs[f.name] = None
        elif inner is OptimizerConfig:
            kwargs[f.name] = OptimizerConfig(
                value["type"], _params(OPTIMIZER_PARAMS[value["type"]], value, where)
            )
        elif inner is SchedulerConfig:
            kwargs[f.name] = SchedulerConfig(
                value["type"], _params(SCHEDULER_PARAMS[value["type"]], value, where)
            )
        elif is_dataclass(inner):
            kwargs[f.name] = _build(inner, value, where)
        else:
            kwargs[f.name] = value
    return cls(**kwargs)


def _check_numbers(cls: type, data: dict, path: str) -> None:
    """``check_number`` for each value of ``data`` that fills a field of ``cls`` (a section dataclass)."""
    for f in fields(cls):
        if f.name in data and not isinstance(data[f.name], dict):
            where = f"{path}.{f.name}" if path else f.name
            spellings = f.metadata.get("aliases", ())
            check_number(
                where + (f" (or {', '.join(spellings)})" if spellings else ""),
                data[f.name],
                f.metadata.get("bounds"),
            )


def _params(cls: type, value: dict, section: str) -> dict:
    _check_numbers(cls, value["params"], section + ".params")
    params = asdict(cls(**value["params"]))
    for key in REQUIRED_PARAMS & params.keys():
        if params[key] is None:
            raise ConfigError(
                f"{section} type '{value['type']}' needs params.{key}; write it or set it to "
                f'"auto" and pass {key}= to load_config'
            )
    return params
