"""Fill a ds_config's "auto" values from Hugging Face ``TrainingArguments`` and the model, as transformers'
DeepSpeed integration does (``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``_finalize``), and refuse
a value that is not "auto" and disagrees with the arguments, naming both.

The key table (batch triple, clipping, optimizer and scheduler params, ZeRO bucket sizes from the model's
hidden size, fp16/bf16) and what plait adds beyond it (missing batch keys, precision sections, ``ddp_timeout``
as the ``comm`` timeouts) are in ``docs/hf.md``; tests/test_hf_config_fill.py checks every key against the
installed transformers' own code.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch.distributed as dist

from plait.config import ConfigError
from plait.config.resolve import bucket_sizes

log = logging.getLogger("plait")


def _node(config: dict, path: str):
    """(the dict holding the last key of ``path``, that key), or (None, key) when a parent is absent."""
    *parents, key = path.split(".")
    node = config
    for p in parents:
        node = node.get(p)
        if not isinstance(node, dict):
            return None, key
    return node, key


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def hf_hidden_size(model) -> int | None:
    """The hidden size transformers reads for the ZeRO bucket sizes: ``config.hidden_size``, else the largest
    of ``config.hidden_sizes``, else the same from ``config.text_config``; None when there is none."""
    for config in (
        getattr(model, "config", None),
        getattr(getattr(model, "config", None), "text_config", None),
    ):
        if getattr(config, "hidden_size", None) is not None:
            return config.hidden_size
        if getattr(config, "hidden_sizes", None):
            return max(config.hidden_sizes)
    return None


def fill_from_args(
    ds_config: dict, args, dp: int, max_steps: int, hidden_size: int | None = None
) -> dict:
    """A copy of ``ds_config`` with the "auto" values above filled from ``args`` (a ``TrainingArguments``)
    and ``hidden_size`` (the model's, ``hf_hidden_size``; None leaves the bucket sizes to plait's resolver).

    Raises:
        ConfigError: values that are not "auto" disagree with the arguments (all of them named, each with
            its argument and both values).
    """
    config = copy.deepcopy(ds_config)
    pairs = _pairs(config, args, dp, max_steps, hidden_size)
    _precision_sections(config, args)
    mismatches = _fill(config, pairs)
    _script_timeout(config, args)
    if mismatches:
        raise ConfigError(
            'the ds_config and the TrainingArguments disagree; set these to "auto" in the ds_config '
            "or make them equal:\n" + "\n".join(mismatches)
        )
    return config


def _pairs(config: dict, args, dp: int, max_steps: int, hidden_size: int | None) -> list[tuple]:
    """The key table: (ds_config path, value from ``args``, the argument's name, whether a value that is not
    "auto" must equal it)."""
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    pairs = [
        ("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", True),
        ("gradient_accumulation_steps", gas, "gradient_accumulation_steps", True),
        (
            "train_batch_size",
            micro * gas * dp,
            "train_batch_size (per_device_train_batch_size x gradient_accumulation_steps x dp)",
            True,
        ),
        ("gradient_clipping", args.max_grad_norm, "max_grad_norm", True),
        ("optimizer.params.lr", args.learning_rate, "learning_rate", True),
        (
            "optimizer.params.betas",
            [args.adam_beta1, args.adam_beta2],
            "adam_beta1+adam_beta2",
            True,
        ),
        ("optimizer.params.eps", args.adam_epsilon, "adam_epsilon", True),
        ("optimizer.params.weight_decay", args.weight_decay, "weight_decay", True),
        ("scheduler.params.warmup_min_lr", 0, None, False),
        ("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate", True),
        (
            "scheduler.params.warmup_num_steps",
            max(1, args.get_warmup_steps(max_steps)),
            "warmup_steps",
            True,
        ),
        ("scheduler.params.total_num_steps", max_steps, "max_steps (computed)", True),
        ("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval", True),
        ("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval", True),
    ]
    if hidden_size is not None:
        stage3 = config.get("zero_optimization", {}).get("stage") == 3
        pairs += [
            (f"zero_optimization.{key}", size, None, False)
            for key, size in bucket_sizes(hidden_size).items()
            if stage3 or not key.startswith("stage3_")
        ]
    return pairs


def _precision_sections(config: dict, args) -> None:
    """``bfloat16`` read as ``bf16``; the Trainer's mixed precision enables a section the config does not have
    (accelerate's DeepSpeed plugin)."""
    if "bfloat16" in config and "bf16" not in config:
        config["bf16"] = config.pop("bfloat16")
    if args.bf16 and "bf16" not in config:
        config["bf16"] = {"enabled": True}
    if args.fp16 and "fp16" not in config:
        config["fp16"] = {"enabled": True, "auto_cast": True}


def _fill(config: dict, pairs: list[tuple]) -> list[str]:
    """Fill each "auto" of ``pairs`` in ``config``; the lines naming values that disagree (none: [])."""
    mismatches = []
    for path, value, arg, must_match in pairs:
        node, key = _node(config, path)
        if node is None:
            continue
        # "auto", or a micro-batch / accumulation key the config leaves out (accelerate fills those too)
        if node.get(key) == "auto" or (
            node is config
            and key not in node
            and key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        ):
            node[key] = value
        elif must_match and key in node and not _same(node[key], value):
            mismatches.append(
                f"- ds_config {path} = {node[key]!r} vs TrainingArguments {arg} = {value!r}"
            )
    return mismatches


def check_batch(engine, args) -> None:
    """Raises ConfigError: ``engine``'s micro-batch or accumulation differs from ``args``'."""
    got = (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())
    if got != (args.per_device_train_batch_size, args.gradient_accumulation_steps):
        raise ConfigError(
            f"the ds_config resolves to micro-batch {got[0]} x accumulation {got[1]}, but the "
            f"TrainingArguments ask {args.per_device_train_batch_size} x "
            f'{args.gradient_accumulation_steps}; set the batch keys to "auto" or make them agree'
        )


def say_filled(raw: dict, filled: dict, args) -> None:
    """Log on rank 0 what the filling changed beyond "auto" values. The Trainer calls it once, for the engine it
    trains (TRL's reference engine fills a second config and says nothing):

    - the ds_config has no ``gradient_clipping`` key: DeepSpeed then clips nothing (its default 0), and so does
      plait, while the same script without a ds_config clips at ``max_grad_norm`` (a warning naming the key);
    - the ``comm`` timeouts came from ``TrainingArguments.ddp_timeout`` (``_script_timeout``)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if "gradient_clipping" not in filled and args.max_grad_norm:
        log.warning(
            "the ds_config has no gradient_clipping key: as under DeepSpeed, gradients are not clipped and "
            'TrainingArguments max_grad_norm=%s is not used; add "gradient_clipping": "auto" to the '
            "ds_config to clip at max_grad_norm",
            args.max_grad_norm,
        )
    if filled.get("comm") != raw.get("comm"):
        log.info("comm timeouts: %s s from TrainingArguments.ddp_timeout", args.ddp_timeout)


def _script_timeout(config: dict, args) -> None:
    """``comm.timeout_s`` and ``comm.startup_timeout_s`` from a ``ddp_timeout`` the script set (see the module
    docstring)."""
    default = next((f.default for f in dataclasses.fields(args) if f.name == "ddp_timeout"), None)
    comm = config.get("comm", {})
    if args.ddp_timeout == default or "timeout_s" in comm or "startup_timeout_s" in comm:
        return
    config["comm"] = {
        **comm,
        "timeout_s": float(args.ddp_timeout),
        "startup_timeout_s": float(args.ddp_timeout),
    }
