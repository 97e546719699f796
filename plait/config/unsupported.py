"""DeepSpeed config keys that plait knows but does not implement.

plait never ignores a key silently: a DeepSpeed feature it lacks raises :class:`UnsupportedConfigError`
naming the key and what to do instead. A key written in its *off* form is accepted, because many shared
ds_configs carry disabled sections such as ``"flops_profiler": {"enabled": false}``:

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


_LOG = "log metrics from your training loop instead"
_REMOVE = "remove the section"


def _table(entries: dict) -> MappingProxyType:
    return MappingProxyType({k: (v[0], v[1]) for k, v in entries.items()})


#: section path ("" = top level) -> key -> (off values or SECTION, what to do instead)
UNSUPPORTED_KEYS = MappingProxyType({
    "": _table({
        "amp": (SECTION, "use fp16 or bf16 mixed precision"),
        "flops_profiler": (SECTION, "profile with torch.profiler instead"),
        "tensorboard": (SECTION, _LOG), "wandb": (SECTION, _LOG), "csv_monitor": (SECTION, _LOG),
        "comms_logger": (SECTION, _LOG),
        "autotuning": (SECTION, "size the run with `plait estimate-memory` instead"),
        "elasticity": (SECTION, "fix train_batch_size and the data-parallel size"),
        "sparse_attention": (SECTION, _REMOVE), "compression_training": (SECTION, _REMOVE),
        "curriculum_learning": (SECTION, _REMOVE), "data_efficiency": (SECTION, _REMOVE),
        "progressive_layer_drop": (SECTION, _REMOVE), "eigenvalue": (SECTION, _REMOVE),
        "quantize_training": (SECTION, _REMOVE), "weight_quantization": (SECTION, _REMOVE),
        "hybrid_engine": (SECTION, _REMOVE), "compile": (SECTION, "call torch.compile on the model yourself"),
        "nebula": (SECTION, "plait saves sharded safetensors checkpoints itself"),
        "aio": (SECTION, "NVMe offload is not implemented; offload to \"cpu\""),
        "checkpoint": (SECTION, "plait checkpoints are layout-free and reshard on load; remove the section"),
        "data_types": (SECTION, "use communication_data_type for the gradient reduction dtype"),
        "torch_autocast": (SECTION, "use fp16 or bf16 mixed precision"),
        "sparse_gradients": ((False,), "remove it (dense gradients only)"),
        "fp32_allreduce": ((False,), "use \"communication_data_type\": \"fp32\""),
        "disable_allgather": ((False,), "remove it"),
        "dataloader_drop_last": ((False,), "build the DataLoader yourself"),
        "dump_state": ((False,), "remove it"),
        "zero_force_ds_cpu_optimizer": ((False, True), None),  # DeepSpeed-internal switch; harmless
        "use_data_before_expert_parallelism": ((False,), "remove it (no mixture-of-experts support)"),
        "graph_harvesting": ((False,), "remove it"),
    }),
    "fp16": _table({
        "fp16_master_weights_and_grads": ((False,), "plait keeps fp32 master weights; remove it"),
    }),
    "bf16": _table({
        "immediate_grad_update": ((False,), "remove it"),
    }),
    "optimizer": _table({
        "legacy_fusion": ((False,), "remove it"),
    }),
    "optimizer.params": _table({
        "amsgrad": ((False,), "remove it (AMSGrad is not implemented)"),
        "torch_adam": ((False,), "remove it (plait picks its own kernel)"),
        "fused": ((False,), "remove it (plait picks its own kernel)"),
        "eps_inside_sqrt": ((False,), "remove it"),
        "max_grad_norm": ((0, 0.0), "use the top-level gradient_clipping"),
    }),
    "zero_optimization": _table({
        "cpu_offload": ((False,), "use \"offload_optimizer\": {\"device\": \"cpu\"}"),
        "cpu_offload_params": ((False,), "use \"offload_param\": {\"device\": \"cpu\"}"),
        "cpu_offload_use_pin_memory": ((False,), "use offload_optimizer.pin_memory"),
        "elastic_checkpoint": ((False,), "remove it (plait checkpoints reshard on load)"),
        "load_from_fp32_weights": ((True,), "remove it (plait always restores fp32 master weights)"),
        "round_robin_gradients": ((False,), "remove it"),
        "zero_hpz_partition_size": ((1,), "remove it (ZeRO++ hierarchical partitioning is not implemented)"),
        "zero_quantized_weights": ((False,), "remove it (ZeRO++ quantized weights are not implemented)"),
        "zero_quantized_nontrainable_weights": ((False,), "remove it"),
        "zero_quantized_gradients": ((False,), "remove it (ZeRO++ quantized gradients are not implemented)"),
        "zeropp_loco_param": ((None,), "remove it"),
        "mics_shard_size": ((-1,), "remove it (MiCS sharding is not implemented)"),
        "mics_hierarchical_params_gather": ((False,), "remove it"),
        "legacy_stage1": ((False,), "remove it"),
        "use_multi_rank_bucket_allreduce": ((False, True), None),  # DeepSpeed-internal switch
        "memory_efficient_linear": ((False, True), None),  # DeepSpeed-internal switch
        "log_trace_cache_warnings": ((False,), "remove it"),
    }),
    "zero_optimization.offload_optimizer": _table({
        "nvme_path": ((None,), "NVMe offload is not implemented; offload to \"cpu\""),
        "buffer_count": ((4,), "remove it (NVMe only)"),
        "fast_init": ((False,), "remove it (NVMe only)"),
        "pipeline_read": ((False,), "remove it (NVMe only)"), "pipeline_write": ((False,), "remove it (NVMe only)"),
        "pipeline": ((False,), "remove it (NVMe only)"),
        "ratio": ((1, 1.0), "remove it (partial offload is not implemented)"),
    }),
    "zero_optimization.offload_param": _table({
        "nvme_path": ((None,), "NVMe offload is not implemented; offload to \"cpu\""),
        "buffer_count": ((5,), "remove it (NVMe only)"),
        "buffer_size": ((100_000_000,), "remove it (NVMe only)"),
        "max_in_cpu": ((1_000_000_000,), "remove it (NVMe only)"),
    }),
    "pipeline": _table({
        "seed_layers": ((False,), "remove it (plait seeds every layer from (seed, layer, name))"),
        "activation_checkpoint_interval": ((0,), "use the activation_checkpointing section"),
        "pipe_partitioned": ((False,), "remove it"),
        "grad_partitioned": ((False,), "remove it"),
    }),
})

#: section path -> unsupported values of a key: (key, value) -> what to do instead
UNSUPPORTED_VALUES = MappingProxyType({
    "zero_optimization.offload_optimizer": MappingProxyType(
        {("device", "nvme"): "NVMe offload (ZeRO-Infinity) is not implemented; use \"cpu\""}),
    "zero_optimization.offload_param": MappingProxyType(
        {("device", "nvme"): "NVMe offload (ZeRO-Infinity) is not implemented; use \"cpu\""}),
    "pipeline": MappingProxyType({("partition", "type"): "regex partitioning is not implemented; use "
                                  "\"uniform\", \"parameters\" or explicit boundaries"}),
})

#: optimizer / scheduler types DeepSpeed has and plait does not
UNSUPPORTED_OPTIMIZERS = frozenset({"OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad", "MuAdam", "MuAdamW",
                                    "MuSGD", "Muon", "AdamNesterov"})
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
        how = "write it with \"enabled\": false or remove it"
    else:
        is_off = any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off)
        how = "allowed off value(s): " + ", ".join(repr(o) for o in off)
    if is_off:
        return True
    where = f"'{section}'" if section else "the config"
    raise UnsupportedConfigError(f"plait does not implement DeepSpeed key '{key}' in {where} "
                                 f"(got {value!r}); {hint or 'remove it'} ({how})")


def check_unsupported_value(section: str, key: str, value: object) -> None:
    """Raise UnsupportedConfigError for a DeepSpeed value plait does not implement (e.g. device "nvme")."""
    for (k, v), hint in UNSUPPORTED_VALUES.get(section, {}).items():
        if k == key and isinstance(value, str) and (value == v or value.startswith(v + ":")):
            raise UnsupportedConfigError(f"plait does not implement {section}.{key} = {value!r}; {hint}")
