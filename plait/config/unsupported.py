"""DeepSpeed config keys that plait knows but does not implement.

plait never ignores a key silently: a DeepSpeed feature it lacks raises :class:`UnsupportedConfigError`
naming the key and what to do instead. A key written in its *off* form is accepted, because many shared
ds_configs carry disabled sections such as ``"progressive_layer_drop": {"enabled": false}``; keys that do not
change the trained weights are accepted in any form (:mod:`plait.config.accepted`):

* a section (JSON object) is off when it says ``"enabled": false``;
* a scalar key is off when its value is one of the listed off values (DeepSpeed's disabled default).

Names follow the DeepSpeed configuration reference (https://www.deepspeed.ai/docs/config-json/).
"""

from __future__ import annotations

from types import MappingProxyType

from plait.config.schema import ConfigError

SECTION = object()  # marker: the key is a section, off when it has "enabled": false


class UnsupportedConfigError(ConfigError):
    """A DeepSpeed key or value plait does not implement (a ValueError)."""


_REMOVE = "remove the section"


def _table(entries: dict) -> MappingProxyType:
    return MappingProxyType({k: (v[0], v[1]) for k, v in entries.items()})


#: section path ("" = top level) -> key -> (off values or SECTION, what to do instead). Each is a feature
#: that changes the trained weights or the data a step sees; keys that do not are in plait.config.accepted.
UNSUPPORTED_KEYS = MappingProxyType(
    {
        "": _table(
            {
                "amp": (SECTION, "use fp16 or bf16 mixed precision (apex AMP is not implemented)"),
                "comet": (SECTION, "use csv_monitor, tensorboard or wandb"),
                "elasticity": (SECTION, "fix train_batch_size and the data-parallel size"),
                "sparse_attention": (SECTION, _REMOVE),
                "compression_training": (SECTION, _REMOVE),
                "curriculum_learning": (SECTION, _REMOVE),
                "data_efficiency": (SECTION, _REMOVE),
                "progressive_layer_drop": (SECTION, _REMOVE),
                "quantize_training": (SECTION, _REMOVE),
                "weight_quantization": (SECTION, _REMOVE),
                "hybrid_engine": (SECTION, _REMOVE),
                "torch_autocast": (
                    SECTION,
                    "use fp16 or bf16 mixed precision (16-bit weights with fp32 masters)",
                ),
                "sparse_gradients": ((False,), "remove it (dense gradients only)"),
                "fp32_allreduce": ((False,), 'use "communication_data_type": "fp32"'),
                "dataloader_drop_last": ((False,), "build the DataLoader yourself"),
                "use_data_before_expert_parallelism": (
                    (False,),
                    "remove it (no mixture-of-experts support)",
                ),
                "sequence_parallel_size": (
                    (1,),
                    "DeepSpeed's Ulysses sequence parallelism is plait's context parallelism: "
                    "write context_parallel: {size: N, method: all_to_all} instead",
                ),
            }
        ),
        "fp16": _table(
            {
                "fp16_master_weights_and_grads": (
                    (False,),
                    "plait keeps fp32 master weights; remove it",
                ),
            }
        ),
        "bf16": _table(
            {
                "bf16_master_weights_and_grads": (
                    (False,),
                    "plait keeps fp32 master weights and gradients; remove it",
                ),
            }
        ),
        "optimizer.params": _table(
            {
                "amsgrad": ((False,), "remove it (AMSGrad is not implemented)"),
                "eps_inside_sqrt": (
                    (False,),
                    "remove it (eps is added outside the square root, as torch's Adam)",
                ),
                "max_grad_norm": ((0, 0.0), "use the top-level gradient_clipping"),
            }
        ),
        "zero_optimization": _table(
            {
                "legacy_stage1": ((False,), "remove it (plait has one stage-1 implementation)"),
                "zero_quantized_weights": (
                    (False,),
                    "remove it (ZeRO++ quantized weights are not implemented)",
                ),
                "zero_quantized_nontrainable_weights": ((False,), "remove it"),
                "zero_quantized_gradients": (
                    (False,),
                    "remove it (ZeRO++ quantized gradients are not implemented)",
                ),
                "zeropp_loco_param": ((None,), "remove it"),
                "zenflow": (
                    SECTION,
                    "ZenFlow's asynchronous top-k updates are not implemented; remove it for "
                    "ZeRO-Offload's exact step",
                ),
            }
        ),
        "tensor_parallel": _table(
            {
                "autotp_size": (
                    (0, 1),
                    "DeepSpeed's AutoTP of Hugging Face models is not implemented; build the model "
                    "from plait.layers and set tensor_parallel.size",
                ),
                "tp_size": (
                    (0, 1),
                    "DeepSpeed's AutoTP of Hugging Face models is not implemented; build the model from "
                    "plait.layers and set tensor_parallel.size",
                ),
            }
        ),
        "pipeline": _table(
            {
                "activation_checkpoint_interval": (
                    (0,),
                    "use the activation_checkpointing section",
                ),
            }
        ),
    }
)

#: section path -> unsupported values of a key: (key, value) -> what to do instead
UNSUPPORTED_VALUES = MappingProxyType(
    {
        "zero_optimization.offload_optimizer": MappingProxyType(
            {("device", "nvme"): 'NVMe offload (ZeRO-Infinity) is not implemented; use "cpu"'}
        ),
        "zero_optimization.offload_param": MappingProxyType(
            {("device", "nvme"): 'NVMe offload (ZeRO-Infinity) is not implemented; use "cpu"'}
        ),
        "pipeline": MappingProxyType(
            {
                ("partition", "type"): "regex partitioning is not implemented; use "
                '"uniform", "parameters" or explicit boundaries'
            }
        ),
    }
)

#: optimizer / scheduler types DeepSpeed has and plait does not
UNSUPPORTED_OPTIMIZERS = frozenset(
    {
        "OneBitAdam",
        "OnebitAdam",
        "ZeroOneAdam",
        "OneBitLamb",
        "Adagrad",
        "MuAdam",
        "MuAdamW",
        "MuSGD",
        "Muon",
        "AdamNesterov",
    }
)
UNSUPPORTED_SCHEDULERS = frozenset({"OneCycle", "LRRangeTest", "WarmupCosineLRWithRestarts"})


def check_unsupported(section: str, key: str, value: object) -> bool:
    """Return True when ``key`` is a known-unsupported DeepSpeed key written in its off form (accept and
    drop it); False when it is not in the table. Raises UnsupportedConfigError when it is switched on."""
    entry = UNSUPPORTED_KEYS.get(section, {}).get(key)
    if entry is None:
        return False
    off, hint = entry
    if off is SECTION:
        is_off = isinstance(value, dict) and value.get("enabled") is False
        how = 'write it with "enabled": false or remove it'
    else:
        is_off = any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off)
        how = "allowed off value(s): " + ", ".join(repr(o) for o in off)
    if is_off:
        return True
    where = f"'{section}'" if section else "the config"
    raise UnsupportedConfigError(
        f"plait does not implement DeepSpeed key '{key}' in {where} "
        f"(got {value!r}); {hint or 'remove it'} ({how})"
    )


def check_unsupported_value(section: str, key: str, value: object) -> None:
    """Raise UnsupportedConfigError for a DeepSpeed value plait does not implement (e.g. device "nvme")."""
    for (k, v), hint in UNSUPPORTED_VALUES.get(section, {}).items():
        if k == key and isinstance(value, str) and (value == v or value.startswith(v + ":")):
            raise UnsupportedConfigError(
                f"plait does not implement {section}.{key} = {value!r}; {hint}"
            )
