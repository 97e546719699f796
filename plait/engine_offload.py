"""ZeRO-Offload options from a ds_config, with the combinations the engine refuses."""
from __future__ import annotations

import os

from plait.config import ConfigError, PlaitConfig
from plait.optim.lamb import Lamb
from plait.zero.offload import OffloadOptions


def offload_options(config: PlaitConfig, pipeline, optimizer) -> OffloadOptions | None:
    """``OffloadOptions`` from ``zero_optimization.offload_optimizer`` / ``offload_param`` (None when both
    are off). ``pin_memory`` of either section pins the host buffers; the CPU optimizer's thread count
    comes from the environment variable ``PLAIT_OFFLOAD_THREADS`` (default: every core numba sees).
    ``device_step_fraction`` (a number, "auto": the adaptive split, or None: "auto" where it applies) is passed
    on as read; the deprecated
    ``device_step_adaptive`` was folded into it by the config (``plait.config.schema_zero.OffloadConfig``).

    Raises:
        ConfigError: offload with a pipeline, LAMB with offload_optimizer, a bad PLAIT_OFFLOAD_THREADS.
    """
    z = config.zero_optimization
    if not (z.offload_optimizer.enabled or z.offload_param.enabled):
        return None
    if pipeline is not None:
        raise ConfigError("zero_optimization.offload_optimizer / offload_param with pipeline parallelism is not "
                          "supported yet; remove the offload sections or use pipeline.size 1")
    kind = config.optimizer.type.lower() if optimizer is None and config.optimizer is not None else None
    if z.offload_optimizer.enabled and (kind == "lamb" or isinstance(optimizer, Lamb) or optimizer is Lamb):
        raise ConfigError("LAMB cannot run offloaded: its per-tensor trust ratio needs norms summed over the dp "
                          "ranks sharing a tensor, which the CPU kernels do not do; use Adam/AdamW/Lion with "
                          "offload_optimizer, or LAMB without it")
    threads = os.environ.get("PLAIT_OFFLOAD_THREADS")
    if threads is not None and not threads.isdigit():
        raise ConfigError(f"PLAIT_OFFLOAD_THREADS={threads!r} must be a positive integer (CPU optimizer threads)")
    return OffloadOptions(optimizer=z.offload_optimizer.enabled, param=z.offload_param.enabled,
                          pin_memory=z.offload_optimizer.pin_memory or z.offload_param.pin_memory,
                          num_threads=int(threads) if threads else None,
                          device_step_fraction=z.offload_optimizer.device_step_fraction)
