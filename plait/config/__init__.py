"""Typed training configuration read from DeepSpeed-style JSON (ds_config key names).

    from plait.config import load_config
    cfg = load_config("ds_config.json", dp_size=8, model_hidden_size=4096)
    cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu, cfg.to_dict()

Modules: ``schema`` (the frozen dataclasses), ``reader`` (key and type checks, ``load_config``),
``resolve`` ("auto" rules and the batch-size triple), ``unsupported`` (DeepSpeed keys plait rejects).
"""

from plait.config.reader import load_config, read_raw
from plait.config.schema import (
    AUTO,
    ActivationCheckpointingConfig,
    AdamParams,
    BF16Config,
    ConfigError,
    ContextParallelConfig,
    FP16Config,
    LambParams,
    LionParams,
    OffloadConfig,
    OptimizerConfig,
    PipelineConfig,
    PlaitConfig,
    SchedulerConfig,
    SGDParams,
    TensorParallelConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    ZeroConfig,
)
from plait.config.unsupported import UnsupportedConfigError

__all__ = [
    "AUTO",
    "ActivationCheckpointingConfig",
    "AdamParams",
    "BF16Config",
    "ConfigError",
    "ContextParallelConfig",
    "FP16Config",
    "LambParams",
    "LionParams",
    "OffloadConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "PlaitConfig",
    "SchedulerConfig",
    "SGDParams",
    "TensorParallelConfig",
    "UnsupportedConfigError",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "ZeroConfig",
    "load_config",
    "read_raw",
]
