"""DeepSpeed config keys plait reads and drops because they do not change the trained weights.

Shared ds_configs carry switches that tune DeepSpeed's own machinery (bucket orderings, NVMe queues,
profilers, DeepCompile's passes, logging of communication) or that DeepSpeed itself ignores in the given
setting (``offload_param`` below stage 3). A config holding them trains on plait exactly as written.
Where DeepSpeed would do something visible that plait does not (print a FLOPs profile, keep a bf16
gradient accumulator) the reader logs one line naming the key and what plait does instead; keys
in their off form, or whose effect is only DeepSpeed-internal, are dropped silently.

A key that would change training and is not implemented is refused instead
(:mod:`plait.config.unsupported`). Names follow the DeepSpeed configuration reference
(https://www.deepspeed.ai/docs/config-json/) and DeepSpeed's config models.
"""

from __future__ import annotations

import logging
from types import MappingProxyType

SECTION = object()  # marker: a section, off when it says "enabled": false (or is empty)
ANY = (
    object()
)  # marker: no off form; any value is dropped silently (notice None) or with the notice

log = logging.getLogger("plait")

_NVME = "an NVMe-offload setting; plait offloads to CPU memory only"


def _data_types_notice(value) -> str | None:
    accum = value.get("grad_accum_dtype") if isinstance(value, dict) else None
    if accum is None or str(accum).lower() in ("fp32", "float32", "torch.float32"):
        return None
    return (
        f"plait accumulates gradients in fp32, not {accum} (each micro-batch's gradient is added without "
        "rounding; DeepSpeed's 16-bit accumulator rounds the sum, so losses differ at that rounding)"
    )


def _table(entries: dict) -> MappingProxyType:
    return MappingProxyType(dict(entries))


#: section path ("" = top level) -> key -> (off values, SECTION, ANY or a predicate of the value; the
#: notice when on: a text, a function of the value giving a text or None, or None)
ACCEPTED_KEYS = MappingProxyType(
    {
        "": _table(
            {
                "flops_profiler": (
                    SECTION,
                    "no FLOPs profile is printed; profile with torch.profiler",
                ),
                "comms_logger": (
                    SECTION,
                    "communication is not logged; profile with torch.profiler",
                ),
                "autotuning": (
                    SECTION,
                    "autotuning runs from DeepSpeed's launcher; plait trains with the values as "
                    "written",
                ),
                "aio": (ANY, None),  # read only by NVMe offload, which is refused
                "checkpoint": (
                    ANY,
                    None,
                ),  # plait checkpoints are universal: they reshard on every load
                "nebula": (
                    SECTION,
                    "checkpoints are written by plait itself (sharded safetensors)",
                ),
                "disable_allgather": (ANY, None),  # deprecated in DeepSpeed; no effect there either
                "dump_state": ((False,), "the engine state is not printed at start-up"),
                "graph_harvesting": (
                    ANY,
                    None,
                ),  # CUDA-graph replay of DeepSpeed's kernels: speed only
                "zero_force_ds_cpu_optimizer": (ANY, None),
                "seq_parallel_communication_data_type": (
                    ANY,
                    None,
                ),  # read only with sequence_parallel_size > 1
                "data_types": (ANY, _data_types_notice),
                "timers": (ANY, None),  # DeepSpeed's throughput timer switches: reporting only
                "eigenvalue": (
                    SECTION,
                    "Hessian eigenvalues are not computed (they only feed quantize_training, "
                    "which is refused)",
                ),
            }
        ),
        "bf16": _table(
            {
                "immediate_grad_update": (
                    ANY,
                    None,
                ),  # when bf16 gradients land in fp32 accumulators: same values
                "check_grad_overflow": (
                    ANY,
                    None,
                ),  # plait checks every step's norm (nonfinite_guard)
                "loss_scale": (ANY, None),  # DeepSpeed scales no bf16 loss either
            }
        ),
        "optimizer": _table({"legacy_fusion": (ANY, None)}),
        "compile": _table(
            {
                key: (ANY, None)
                for key in (  # DeepCompile's passes and their tuning (DeepSpeed >= 0.16)
                    "autoep_non_moe",
                    "free_activation",
                    "free_activation_threshold",
                    "offload_activation",
                    "offload_activation_pin_memory",
                    "offload_opt_states",
                    "double_buffer",
                    "symmetric_memory",
                    "debug_log",
                    "dump_graphs",
                    "offload_parameters",
                    "sync_before_reduce",
                    "sync_after_reduce",
                    "sync_before_allgather",
                    "sync_after_allgather",
                    "keep_int_input_tensors",
                    "keep_all_input_tensors",
                    "passes",
                )
            }
        ),
        "optimizer.params": _table(
            {
                "torch_adam": (ANY, None),
                "fused": (ANY, None),
                "foreach": (ANY, None),  # kernel choice, same update
            }
        ),
        "zero_optimization": _table(
            {
                "round_robin_gradients": (
                    ANY,
                    None,
                ),  # order of gradient partitions in offload copies
                "elastic_checkpoint": (ANY, None),
                "load_from_fp32_weights": (ANY, None),
                "use_multi_rank_bucket_allreduce": (ANY, None),
                "memory_efficient_linear": (ANY, None),
                "log_trace_cache_warnings": (ANY, None),
                "pipeline_loading_checkpoint": (ANY, None),
                "override_module_apply": (ANY, None),
                "model_persistence_threshold": (ANY, None),
                "stage3_model_persistence_threshold": (ANY, None),
                "module_granularity_threshold": (ANY, None),
                "stage3_module_granularity_threshold": (ANY, None),
                "use_all_reduce_for_fetch_params": (ANY, None),
                "stage3_use_all_reduce_for_fetch_params": (ANY, None),
                "enable_sanity_checks": (ANY, None),
                "zero_hpz_partition_size": (
                    (1,),
                    "ZeRO++ secondary partitions (hpZ) are not kept: the same "
                    "weights, with the inter-node all-gather of plain ZeRO-3",
                ),
                "mics_shard_size": (
                    (-1,),
                    "MiCS sub-group sharding is not implemented: parameters are sharded over "
                    "the whole data-parallel group (same weights, less per-rank memory)",
                ),
                "mics_hierarchical_params_gather": (ANY, None),
            }
        ),
        "zero_optimization.offload_optimizer": _table(
            {
                "buffer_count": (ANY, None),
                "fast_init": (ANY, None),
                "pipeline_read": (ANY, None),
                "pipeline_write": (ANY, None),
                "pipeline": (ANY, None),
                "nvme_path": ((None,), _NVME),
            }
        ),
        "zero_optimization.offload_param": _table(
            {
                "buffer_count": (ANY, None),
                "buffer_size": (ANY, None),
                "max_in_cpu": (ANY, None),
                "nvme_path": ((None,), _NVME),
            }
        ),
        "pipeline": _table(
            {
                "seed_layers": (
                    ANY,
                    None,
                ),  # plait seeds every layer from (seed, layer, name) anyway
                "pipe_partitioned": (ANY, None),
                "grad_partitioned": (ANY, None),
            }
        ),
    }
)


def _is_off(off, value) -> bool:
    if callable(off):
        return bool(off(value))
    if off is SECTION:
        return isinstance(value, dict) and (not value or value.get("enabled") is False)
    if off is ANY:
        return False
    return any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off)


def check_accepted(section: str, key: str, value: object) -> bool:
    """True when ``key`` in ``section`` is read and dropped (logging its notice once when it is on and has
    one); False when the key is not in the table, or is on with no notice (``plait.config.unsupported``
    then refuses it)."""
    entry = ACCEPTED_KEYS.get(section, {}).get(key)
    if entry is None:
        return False
    off, notice = entry
    if isinstance(off, tuple) and notice is None and not _is_off(off, value):
        return False  # on, and no notice says it is harmless: plait.config.unsupported decides
    if callable(notice):
        notice = notice(value)
    if notice is not None and not _is_off(off, value):
        where = f"{section}.{key}" if section else key
        log.warning("config: %s = %s is accepted: %s", where, _short(value), notice)
    return True


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
