"""Typed configuration sections, named after DeepSpeed's ds_config keys.

Every field keeps DeepSpeed's JSON key name and default (https://www.deepspeed.ai/docs/config-json/),
so a ds_config written for DeepSpeed or the Hugging Face Trainer reads unchanged; plait's own sections
(``tensor_parallel``, ``pipeline``, ``seed``) follow the same style. The dataclasses are frozen; build
them with :func:`plait.config.load_config` (constructing them directly skips all but the
``__post_init__`` checks). Optimizer and scheduler sections live in ``schema_optim``, ZeRO's in
``schema_zero``, the tensor, context and pipeline parallel sections in ``schema_parallel``, ``AUTO`` / ``ConfigError`` in ``schema_base``; every public name is importable from
here. Field metadata the reader uses (``auto``, ``aliases``, ``bounds``): ``docs/config.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from plait.config.monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig
from plait.config.schema_base import AUTO, ConfigError, _auto, bounded  # noqa: F401
from plait.config.schema_optim import (
    OPTIMIZER_PARAMS,
    REQUIRED_PARAMS,
    SCHEDULER_PARAMS,  # noqa: F401
    AdamParams,
    LambParams,
    LionParams,
    OptimizerConfig,
    SchedulerConfig,
    SGDParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    state_dtype_of,
)
from plait.config.schema_fp8 import FP8_RECIPES, FP8Config  # noqa: F401
from plait.config.schema_parallel import (
    CP_METHODS,
    PIPELINE_SCHEDULES,  # noqa: F401
    ContextParallelConfig,
    PipelineConfig,
    TensorParallelConfig,
)
from plait.config.schema_zero import OffloadConfig, ZeroConfig  # noqa: F401


# ----------------------------------------------------------------------------------------------- precision
@dataclass(frozen=True)
class FP16Config:
    """``fp16``: fp16 mixed precision with dynamic loss scaling (Micikevicius et al. 2018, Sec. 3.2).

    ``loss_scale`` 0 selects dynamic scaling starting at ``2**initial_scale_power``; the scale halves on an
    overflow after ``hysteresis`` consecutive overflowing steps (never below ``min_loss_scale``) and doubles
    after ``loss_scale_window`` clean steps. A positive ``loss_scale`` is a fixed (static) scale.
    """

    enabled: bool = _auto(False)
    auto_cast: bool = False
    loss_scale: float = bounded(0.0, ge=0)
    initial_scale_power: int = bounded(16, ge=0, le=127)  # 2**127: the largest power of two in fp32
    loss_scale_window: int = bounded(1000, ge=1)
    hysteresis: int = bounded(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = bounded(1.0, gt=0)

    @property
    def dynamic(self) -> bool:
        """True when the loss scale is dynamic (``loss_scale == 0``)."""
        return self.loss_scale == 0


@dataclass(frozen=True)
class BF16Config:
    """``bf16`` (alias ``bfloat16``): bf16 compute with fp32 master weights; no loss scaling needed.
    ``bf16_optimizer_states`` (DeepSpeed's): Adam's moments stored in bf16, as ``optimizer.params.state_dtype``
    "bf16" (``PlaitConfig.optimizer_state_dtype``)."""

    enabled: bool = _auto(False)
    bf16_optimizer_states: bool = False


# --------------------------------------------------------------------------------- activation checkpoints
@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing`` (Chen et al. 2016; Megatron-LM's partitioned variant): which layers'
    inputs are kept and recomputed. ``number_checkpoints`` None means every layer boundary."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = bounded(None, ge=0)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


# ------------------------------------------------------------------------------------------------ compile
@dataclass(frozen=True)
class CompileConfig:
    """``compile``: regional ``torch.compile`` of each transformer block inside ``initialize``, as
    torchtitan does (``plait.engine.compile``); the ZeRO hooks, activation checkpointing and the pipeline
    schedule stay outside the compiled regions.

    On when ``enabled`` is true, or ``disable`` is false (DeepSpeed 0.13-0.14's spelling), or
    ``deepcompile`` is true (DeepSpeed >= 0.16's ZeRO compiler: plait compiles the same regions instead;
    DeepCompile's own tuning keys are read and dropped). ``backend`` and ``kwargs`` go to
    ``torch.compile(backend=..., **kwargs)`` (``mode``, ``fullgraph``, ``dynamic``, ``options``).
    """

    enabled: bool | None = None
    disable: bool | None = None
    backend: str = "inductor"
    kwargs: dict[str, Any] = field(default_factory=dict)
    deepcompile: bool = False

    @property
    def on(self) -> bool:
        """Whether ``initialize`` compiles the model's blocks."""
        return bool(self.enabled) or self.disable is False or self.deepcompile

    def __post_init__(self) -> None:
        if self.enabled is not None and self.disable is not None and self.enabled == self.disable:
            raise ConfigError(
                f"compile.enabled = {self.enabled} and compile.disable = {self.disable} contradict "
                "each other; keep one of them"
            )
        if "backend" in self.kwargs:
            raise ConfigError("compile.kwargs must not hold 'backend'; set compile.backend instead")


# ------------------------------------------------------------------------------------ plait's own sections
@dataclass(frozen=True)
class NonFiniteGuardConfig:
    """``nonfinite_guard`` (plait): a step whose global gradient norm is inf or nan is skipped on every rank
    in every precision (as Megatron's ``check_for_nan_in_loss_and_grad`` and DeepSpeed's fp16 overflow
    check), counted in ``skipped_steps`` and logged; ``max_consecutive_skips`` such skips in a row end
    the run (fp32/bf16; fp16 has its loss scale's ``min_loss_scale``) with ``NonFiniteError``.
    ``enabled: false`` applies such steps as they are."""

    enabled: bool = True
    max_consecutive_skips: int = 10

    def __post_init__(self) -> None:
        if self.max_consecutive_skips < 1:
            raise ConfigError(
                f"nonfinite_guard.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}"
            )


@dataclass(frozen=True)
class GarbageCollectionConfig:
    """``garbage_collection`` (plait): ``interval`` > 0 turns Python's automatic cyclic collector off for the
    process and runs a full collection after every ``interval``-th optimizer step, the same step on every
    rank (``plait.engine.gc_schedule``; Megatron-LM's ``--manual-gc-interval``); 0 leaves the collector alone."""

    interval: int = 0

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ConfigError(
                "garbage_collection.interval must be >= 0 optimizer steps (0: Python's automatic "
                f"collection), got {self.interval}"
            )


@dataclass(frozen=True)
class CommConfig:
    """``comm`` (plait): collective timeouts, in seconds. ``timeout_s`` holds from the first applied
    optimizer step on, so a frozen or hung rank ends its peers' waits with an error after that long;
    ``startup_timeout_s`` holds before it and during checkpoint saves and loads (compilation, a first
    load, a large save on a slow disk). ``init_distributed(timeout_s=...)`` sets the one before the
    engine exists."""

    timeout_s: float = 180.0
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for key in ("timeout_s", "startup_timeout_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"comm.{key} = {value!r} is out of range: it must be a number of seconds > 0"
                )


@dataclass(frozen=True)
class MemoryCheckConfig:
    """``memory_check`` (plait): ``initialize`` refuses a Llama-style run whose planned GPU or host bytes exceed
    the memory by more than ``margin`` (``plait.fit.check``), before anything is allocated on the device.
    ``seq_len``: tokens per sample for the activations (None: model states only). ``gpu_bytes`` /
    ``host_bytes``: the memory to plan against (None: the device's and the host's own)."""

    enabled: bool = True
    margin: float = bounded(0.10, ge=0)
    seq_len: int | None = bounded(None, ge=1)
    gpu_bytes: int | None = bounded(None, ge=1)
    host_bytes: int | None = bounded(None, ge=1)


# ------------------------------------------------------------------------------------------------ the whole
@dataclass(frozen=True)
class PlaitConfig:
    """A resolved training configuration (ds_config keys plus plait's parallel sections).

    Batch sizes are in samples: ``train_batch_size = train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * dp`` (one optimizer step); ``data_parallel_size`` recovers dp.
    ``gradient_clipping`` is the max global L2 norm (0 = off). ``communication_data_type`` is the dtype of
    gradient reductions ("fp32", "fp16", "bf16"; None = fp32, plait's default). ``gradient_predivide_factor``
    divides gradients before the all-reduce and the rest after. ``seed``: when set, ``initialize`` seeds torch's generators with it;
    unset (the default), it seeds nothing, as DeepSpeed's ``initialize``.
    """

    train_batch_size: int = field(metadata={"auto": True})
    train_micro_batch_size_per_gpu: int = field(metadata={"auto": True})
    gradient_accumulation_steps: int = field(metadata={"auto": True})
    steps_per_print: int = 10
    gradient_clipping: float = bounded(
        0.0, ge=0, auto=True
    )  # the max global gradient norm; 0 = off
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config, metadata={"aliases": ("bfloat16",)})
    fp8: FP8Config = field(default_factory=FP8Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    nonfinite_guard: NonFiniteGuardConfig = field(default_factory=NonFiniteGuardConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    garbage_collection: GarbageCollectionConfig = field(default_factory=GarbageCollectionConfig)
    memory_check: MemoryCheckConfig = field(default_factory=MemoryCheckConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    prescale_gradients: bool = False
    gradient_predivide_factor: float = bounded(1.0, gt=0)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    zero_allow_untested_optimizer: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "fp16.enabled and bf16.enabled are both true; enable at most one of them"
            )
        state_dtype_of(self.optimizer, self.bf16)
        micro, gas, train = (
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            self.train_batch_size,
        )
        if min(micro, gas, train) < 1 or train % (micro * gas) != 0:
            raise ConfigError(
                f"train_batch_size ({train}) must be a positive multiple of "
                f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({gas})"
            )
        mb = self.pipeline.micro_batches
        if mb is not None and mb != gas:
            raise ConfigError(
                f"pipeline.micro_batches ({mb}) differs from gradient_accumulation_steps ({gas}); "
                "a pipeline step runs one micro-batch per accumulation step: make them equal"
            )
        if self.pipeline.cuda_graphs and self.pipeline.num_chunks == 1:
            raise ConfigError(
                "pipeline.cuda_graphs replays pipeline actions, but pipeline.size and virtual_stages "
                "are 1 (no pipeline); set pipeline.size > 1 or drop cuda_graphs"
            )
        if self.pipeline.cuda_graphs and (
            self.zero_optimization.stage == 3 or self.tensor_parallel.size > 1
        ):
            raise ConfigError(
                f"pipeline.cuda_graphs needs zero_optimization.stage <= 2 and tensor_parallel.size 1, "
                f"got stage {self.zero_optimization.stage} and size {self.tensor_parallel.size}: "
                "ZeRO-3 gathers parameters in hooks and tp runs collectives inside the actions, "
                "which a graph cannot replay; set pipeline.cuda_graphs false"
            )
        if self.fp8.enabled and self.fp8.recipe != "tensorwise" and self.tensor_parallel.size > 1:
            raise ConfigError(
                f"fp8.recipe {self.fp8.recipe!r} with tensor_parallel.size {self.tensor_parallel.size}: "
                "plait's tensor-parallel float8 layers scale tensorwise (as torchao's float8 tensor "
                'parallelism); set fp8.recipe "tensorwise" or tensor_parallel.size 1'
            )
        self.fp8.check_parallel(self.zero_optimization.stage, self.tensor_parallel.size)

    @property
    def data_parallel_size(self) -> int:
        """dp = train_batch_size / (micro-batch x gradient accumulation steps)."""
        return self.train_batch_size // (
            self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps
        )

    @property
    def optimizer_state_dtype(self) -> str:
        """How Adam's moments are stored: "fp32", "bf16" or "int8" (``schema_optim.state_dtype_of``)."""
        return state_dtype_of(self.optimizer, self.bf16)

    @property
    def precision(self) -> str:
        """Compute precision: "fp16", "bf16" or "fp32"."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def to_dict(self) -> dict:
        """JSON-serialisable dict with ds_config key names; ``load_config(cfg.to_dict()) == cfg``.

        Tuples become lists; ``None`` optional sections (optimizer, scheduler) and None values are omitted.
        """
        return _to_plain(self)


def _to_plain(value: Any) -> Any:
    if is_dataclass(value):
        out = {}
        for f in fields(value):
            v = getattr(value, f.name)
            if v is not None:
                out[f.name] = _to_plain(v)
        return out
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value
