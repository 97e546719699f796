"""``TrainingArguments.optim`` on plait's engine: the names plait serves become the ds_config's ``optimizer``
section, the names it cannot serve are refused, the rest stay the Trainer's ``create_optimizer``; without a
ds_config ``scheduler`` section, ``lr_scheduler_type`` is the engine's schedule (``hf_scheduler``).

Served: the AdamW names (8-bit, paged, ``adamw_anyprecision``), each mapped to a ``state_dtype``
(``"int8"``, ``"fp32"``, ``"bf16"``), with ``lr``, betas, eps and weight decay as transformers passes them
and no decay on biases and norms. Refused (``REFUSED``): low-precision states of optimizers other than AdamW,
and optimizers whose update reads a whole matrix, which ZeRO's flat master shards do not hold. A ds_config
with its own ``optimizer`` section wins, as in transformers' DeepSpeed integration (a non-default ``optim``
is then logged once). The name table and how "paged" maps to plait: ``docs/hf.md``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist
import transformers

from plait.config import ConfigError

log = logging.getLogger("plait")

INT8 = ("adamw_torch_8bit", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
FP32 = ("paged_adamw_32bit",)
ANYPRECISION = "adamw_anyprecision"
_ANY_DTYPES = {("float32", "float32"): "fp32", ("bfloat16", "bfloat16"): "bf16"}

_LOW_BITS_FIX = (
    'plait serves low-precision states for AdamW only: use optim="adamw_torch_8bit" (8-bit moments) or '
    "a ds_config optimizer of that type"
)
_WHOLE_MATRIX_FIX = (
    "its update reads whole matrices, but plait's ZeRO steps flat shards of them; use "
    'optim="adamw_torch" or "adamw_torch_8bit" (8-bit moments for less memory), or a ds_config '
    '"optimizer" section'
)
REFUSED = {
    "adamw_torch_4bit": 'plait has no 4-bit states; use optim="adamw_torch_8bit" (8-bit block-wise moments)',
    **dict.fromkeys(
        (
            "lion_8bit",
            "paged_lion_8bit",
            "ademamix_8bit",
            "paged_ademamix_8bit",
            "rmsprop_bnb_8bit",
            "galore_adamw_8bit",
            "galore_adamw_8bit_layerwise",
        ),
        _LOW_BITS_FIX,
    ),
    **dict.fromkeys(
        (
            "adafactor",
            "galore_adamw",
            "galore_adafactor",
            "galore_adamw_layerwise",
            "galore_adafactor_layerwise",
            "apollo_adamw",
            "apollo_adamw_layerwise",
            "lomo",
            "adalomo",
            "stable_adamw",
        ),
        _WHOLE_MATRIX_FIX,
    ),
}


def _optim_args(args) -> dict:
    """``args.optim_args`` ("k=v,k=v") as transformers parses it."""
    if not args.optim_args:
        return {}
    return dict(pair.split("=", 1) for pair in args.optim_args.replace(" ", "").split(","))


def state_dtype_for(args) -> str | None:
    """plait's ``optimizer.params.state_dtype`` for ``args.optim``; None: not an AdamW name plait maps.

    Raises:
        ConfigError: a name in ``REFUSED``, or ``adamw_anyprecision`` with dtypes plait does not store (naming
            the value and the fix).
    """
    name = _name(args.optim)
    if name in REFUSED:
        raise ConfigError(
            f"TrainingArguments(optim={name!r}) is not served by plait: {REFUSED[name]}"
        )
    if name in INT8:
        return "int8"
    if name in FP32:
        return "fp32"
    if name != ANYPRECISION:
        return None
    extra = _optim_args(args)
    dtypes = (extra.get("momentum_dtype", "float32"), extra.get("variance_dtype", "float32"))
    if dtypes not in _ANY_DTYPES:
        raise ConfigError(
            f"TrainingArguments(optim='adamw_anyprecision', optim_args=...) asks momentum_dtype="
            f"{dtypes[0]} and variance_dtype={dtypes[1]}; plait stores both moments in float32 or both "
            "in bfloat16: set both to one of them"
        )
    if extra.get("use_kahan_summation", "False").lower() in ("true", "1", "yes"):
        _log_once(
            "optim_args use_kahan_summation: not needed under plait, whose fp32 master weights take the "
            "update (the moments are stored as asked)"
        )
    return _ANY_DTYPES[dtypes]


def hf_optimizer(trainer, config: dict) -> tuple[dict, object, list[dict] | None]:
    """``(config, optimizer, model_parameters)`` for ``plait.initialize`` from the Trainer's ``args.optim``.

    The config's own ``optimizer`` section: kept, ``optim`` logged once when not the default (no optimizer
    passed, plait's grouping). An optimizer the script gave the Trainer (``optimizers=`` or
    ``optimizer_cls_and_kwargs=``): ``trainer.create_optimizer()``, which returns it, as transformers does. A served
    name: the config gains ``{"type": "AdamW", "params": {..., "state_dtype": ...}}`` and the Trainer's decay
    groups. Otherwise: ``trainer.create_optimizer()``, as before.

    Raises:
        ConfigError: ``state_dtype_for``'s refusals (only when the config has no optimizer of its own).
    """
    args = trainer.args
    if config.get("optimizer"):
        default = next(f.default for f in dataclasses.fields(args) if f.name == "optim")
        if _name(args.optim) != _name(default):
            _log_once(
                f'TrainingArguments.optim = {_name(args.optim)} is not used: the ds_config\'s "optimizer" '
                f"section ({config['optimizer'].get('type')}) wins, as under DeepSpeed"
            )
        return config, None, None
    if (
        trainer.optimizer is not None
        or getattr(trainer, "optimizer_cls_and_kwargs", None) is not None
    ):
        return (
            config,
            trainer.create_optimizer(),
            None,
        )  # the script's own optimizer wins over optim, as in HF
    state_dtype = state_dtype_for(args)
    if state_dtype is None:
        return config, trainer.create_optimizer(), None
    params = {
        "lr": args.learning_rate,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "state_dtype": state_dtype,
    }
    return {**config, "optimizer": {"type": "AdamW", "params": params}}, None, decay_groups(trainer)


def hf_scheduler(args, max_steps: int):
    """The engine's ``lr_scheduler`` factory (optimizer -> scheduler) for a ds_config without a ``scheduler``
    section: transformers' ``get_scheduler`` of ``args.lr_scheduler_type`` over ``max_steps``."""

    def scheduler(optimizer):
        return transformers.get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_warmup_steps=args.get_warmup_steps(max_steps),
            num_training_steps=max_steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
        )

    return scheduler


def decay_groups(trainer) -> list[dict]:
    """The Trainer's two param groups (``create_optimizer``): ``args.weight_decay`` on the parameters
    ``get_decay_parameter_names`` names, 0 on the others; frozen parameters left out."""
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": trainer.args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _name(optim) -> str:
    """An ``OptimizerNames`` member or a string, as the string the user wrote."""
    return str(getattr(optim, "value", optim))


def _log_once(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(message)
