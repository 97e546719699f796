"""Typed configuration sections, named after DeepSpeed's ds_config keys.

Every field keeps DeepSpeed's JSON key name and default, so a ds_config written for DeepSpeed (or for the
Hugging Face Trainer's DeepSpeed integration) reads into these dataclasses unchanged; plait's own sections
(``tensor_parallel``, ``pipeline``, ``seed``) follow the same style. Key names and defaults follow the
DeepSpeed configuration reference (https://www.deepspeed.ai/docs/config-json/).

The dataclasses are frozen: a resolved config is a value. Build them with :func:`plait.config.load_config`,
which checks keys and types, resolves ``"auto"`` and the batch-size triple; constructing them directly skips
those checks except the cross-field ones in ``__post_init__``.

Field metadata used by the reader (``plait.config.reader``):
    ``auto``: the key may be ``"auto"`` in JSON; ``plait.config.resolve`` documents each rule.
    ``aliases``: other JSON spellings accepted for the same key (giving two spellings is an error).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import Any, Literal

from plait.config.monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig

AUTO = "auto"


class ConfigError(ValueError):
    """A configuration that plait cannot use; the message names the key, the numbers and the fix."""


def _auto(default: Any = None, **meta: Any) -> Any:
    """A field that may be written as ``"auto"`` in JSON."""
    return field(default=default, metadata={"auto": True, **meta})


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
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        """True when the loss scale is dynamic (``loss_scale == 0``)."""
        return self.loss_scale == 0


@dataclass(frozen=True)
class BF16Config:
    """``bf16`` (alias ``bfloat16``): bf16 compute with fp32 master weights; no loss scaling needed."""

    enabled: bool = _auto(False)


# -------------------------------------------------------------------------------- optimizer and scheduler
def _check_hparams(params: Any) -> None:
    """Range checks of ``optimizer.params`` (values still "auto" are checked once filled in).

    Raises:
        ConfigError: naming the key, the value and the allowed range.
    """
    def bad(key: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(f"optimizer.params.{key} = {value!r} is out of range: it must be {allowed}")

    for key in ("lr", "eps", "weight_decay"):
        v = getattr(params, key, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not (math.isfinite(v) and v >= 0):
            raise bad(key, v, "a finite number >= 0")
    betas = getattr(params, "betas", None)
    if isinstance(betas, (tuple, list)) and not (len(betas) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
        raise bad("betas", list(betas), "two numbers in [0, 1), e.g. [0.9, 0.999]")


@dataclass(frozen=True)
class AdamParams:
    """``optimizer.params`` for Adam / AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019).

    As in DeepSpeed, ``"Adam"`` defaults to decoupled weight decay (``adam_w_mode=True``, i.e. AdamW);
    set ``adam_w_mode: false`` for L2-regularised Adam. ``"AdamW"`` requires ``adam_w_mode`` true.
    """

    lr: float = _auto(1e-3)
    betas: tuple[float, float] = _auto((0.9, 0.999))
    eps: float = _auto(1e-8)
    weight_decay: float = _auto(0.0)
    bias_correction: bool = True
    adam_w_mode: bool = True

    def __post_init__(self) -> None:
        _check_hparams(self)


@dataclass(frozen=True)
class LambParams:
    """``optimizer.params`` for LAMB (You et al. 2020, Alg. 2); the trust ratio is clamped to
    ``[min_coeff, max_coeff]`` as in DeepSpeed's FusedLamb."""

    lr: float = _auto(1e-3)
    betas: tuple[float, float] = _auto((0.9, 0.999))
    eps: float = _auto(1e-8)
    weight_decay: float = _auto(0.0)
    bias_correction: bool = True
    max_coeff: float = 10.0
    min_coeff: float = 0.01

    def __post_init__(self) -> None:
        _check_hparams(self)


@dataclass(frozen=True)
class SGDParams:
    """``optimizer.params`` for SGD with optional (Nesterov) momentum, torch.optim.SGD semantics."""

    lr: float = _auto(1e-3)
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = _auto(0.0)
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_hparams(self)


@dataclass(frozen=True)
class LionParams:
    """``optimizer.params`` for Lion (Chen et al. 2023, Alg. 2)."""

    lr: float = _auto(1e-4)
    betas: tuple[float, float] = _auto((0.9, 0.99))
    weight_decay: float = _auto(0.0)

    def __post_init__(self) -> None:
        _check_hparams(self)


@dataclass(frozen=True)
class WarmupLRParams:
    """``scheduler.params`` for WarmupLR: lr rises from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` steps (``warmup_type`` "log" or "linear"), then stays at ``warmup_max_lr``."""

    warmup_min_lr: float = _auto(0.0)
    warmup_max_lr: float = _auto(0.001)
    warmup_num_steps: int = _auto(1000)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


@dataclass(frozen=True)
class WarmupDecayLRParams:
    """``scheduler.params`` for WarmupDecayLR: WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    total_num_steps: int = _auto(None)  # required
    warmup_min_lr: float = _auto(0.0)
    warmup_max_lr: float = _auto(0.001)
    warmup_num_steps: int = _auto(1000)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


@dataclass(frozen=True)
class WarmupCosineLRParams:
    """``scheduler.params`` for WarmupCosineLR: the lr *ratio* (of the optimizer's lr) warms up from
    ``warmup_min_ratio`` to 1 over ``warmup_num_steps``, then follows a cosine down to ``cos_min_ratio`` at
    ``total_num_steps`` (Loshchilov & Hutter 2017, Eq. 5 without restarts)."""

    total_num_steps: int = _auto(None)  # required
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = _auto(1000)
    cos_min_ratio: float = 0.0001
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


#: Optimizer ``type`` (canonical spelling) -> its params dataclass. Matched case-insensitively.
OPTIMIZER_PARAMS = MappingProxyType({"Adam": AdamParams, "AdamW": AdamParams, "LAMB": LambParams,
                                     "SGD": SGDParams, "Lion": LionParams})
#: Scheduler ``type`` -> its params dataclass. Matched case-insensitively.
SCHEDULER_PARAMS = MappingProxyType({"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
                                     "WarmupCosineLR": WarmupCosineLRParams})
#: Params that must be given (or resolved from "auto") for a scheduler type.
REQUIRED_PARAMS = frozenset({"total_num_steps"})


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` is one of Adam, AdamW, LAMB, SGD, Lion; ``params`` holds every parameter of
    that optimizer with defaults filled in (see :class:`AdamParams` etc.), ``betas`` as a tuple."""

    type: str
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: ``type`` is one of WarmupLR, WarmupDecayLR, WarmupCosineLR; ``params`` uses
    DeepSpeed's names (warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, total_num_steps,
    cos_min_ratio, warmup_min_ratio) with defaults filled in. Steps count optimizer steps."""

    type: str
    params: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------- ZeRO
@dataclass(frozen=True)
class OffloadConfig:
    """``offload_optimizer`` / ``offload_param``: ``device`` "none" or "cpu" (ZeRO-Offload, Ren et al. 2021);
    ``pin_memory`` allocates the host buffers page-locked for faster device copies.
    ``device_step_fraction`` (plait; ``offload_optimizer`` only): the share, in [0, 1), of the optimizer
    partition whose update the device computes from the host-resident states while the CPU steps the
    rest (``plait.zero.offload.device_share``; Adam/AdamW, GAS 1); 0 keeps the whole step on the CPU.
    ``device_step_adaptive`` (plait) starts there and moves the split each step towards equal CPU and
    device times."""

    device: Literal["none", "cpu"] = "none"
    pin_memory: bool = False
    device_step_fraction: float = 0.0
    device_step_adaptive: bool = False

    @property
    def enabled(self) -> bool:
        """True when tensors live on the host (``device == "cpu"``)."""
        return self.device == "cpu"


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization`` (Rajbhandari et al. SC'20). ``stage`` 0: plain data parallel; 1: optimizer
    states partitioned over dp; 2: + gradients; 3: + parameters. Bucket sizes and thresholds count
    *elements* (parameters), not bytes, as in DeepSpeed."""

    stage: int = 0
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: True for stage 3, else False (DeepSpeed's default)
    reduce_scatter: bool = True
    reduce_bucket_size: int = _auto(500_000_000)
    contiguous_gradients: bool = True
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    sub_group_size: int = 1_000_000_000
    stage3_prefetch_bucket_size: int = _auto(50_000_000, aliases=("prefetch_bucket_size",))
    stage3_param_persistence_threshold: int = _auto(100_000, aliases=("param_persistence_threshold",))
    stage3_max_live_parameters: int = _auto(1_000_000_000, aliases=("max_live_parameters",))
    stage3_max_reuse_distance: int = _auto(1_000_000_000, aliases=("max_reuse_distance",))
    stage3_gather_16bit_weights_on_model_save: bool = _auto(
        False, aliases=("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"))
    ignore_unused_parameters: bool = True

    def __post_init__(self) -> None:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.offload_param.enabled and self.stage != 3:   # DeepSpeed reads offload_param at stage 3 only
            logging.getLogger("plait").warning(
                "config: zero_optimization.offload_param is accepted and not used: parameters are offloaded "
                "at stage 3 only (stage %d here), as in DeepSpeed", self.stage)
            object.__setattr__(self, "offload_param", OffloadConfig())
        if self.offload_optimizer.enabled and self.stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (the host holds one "
                             "dp rank's partition of the optimizer states); set \"stage\" to 1, 2 or 3")


# --------------------------------------------------------------------------------- activation checkpoints
@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing`` (Chen et al. 2016; Megatron-LM's partitioned variant): which layers'
    inputs are kept and recomputed. ``number_checkpoints`` None means every layer boundary."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


# ------------------------------------------------------------------------------------ plait's own sections
@dataclass(frozen=True)
class TensorParallelConfig:
    """``tensor_parallel``: ``size`` ranks split each layer's weights (Shoeybi et al. 2019);
    ``sequence_parallel`` also splits norms/dropout activations along the sequence (Korthikanti et al. 2022)."""

    size: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"tensor_parallel.size must be >= 1, got {self.size}")


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class PipelineConfig:
    """``pipeline``: ``size`` stages (DeepSpeed's spelling ``stages`` is accepted too).

    ``schedule``: "gpipe" (Huang et al. 2019), "1f1b" (PipeDream-Flush, Narayanan et al. 2021),
    "interleaved" (1F1B with ``virtual_stages`` model chunks per rank, Narayanan et al. SC'21 Sec. 2.2), or
    "zb-h1" (zero-bubble H1, Qi et al. 2024). ``micro_batches`` per optimizer step equals
    gradient_accumulation_steps (filled in by the reader). ``partition``: "uniform" (equal layer counts),
    "parameters" (balanced parameter counts), or explicit boundaries ``[0, b1, ..., n_layers]``: one more
    layer index than model chunks (``size * virtual_stages``), chunk i holding layers ``[b_i, b_{i+1})``.
    """

    size: int = field(default=1, metadata={"aliases": ("stages",)})
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1"] = "1f1b"
    virtual_stages: int = 1
    micro_batches: int | None = None
    partition: Literal["uniform", "parameters"] | list[int] = "uniform"

    @property
    def num_chunks(self) -> int:
        """Model chunks over all ranks: ``size * virtual_stages``."""
        return self.size * self.virtual_stages

    def __post_init__(self) -> None:
        if self.size < 1 or self.virtual_stages < 1:
            raise ConfigError(f"pipeline.size ({self.size}) and pipeline.virtual_stages ({self.virtual_stages}) "
                             "must be >= 1")
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            raise ConfigError(f"pipeline.schedule 'interleaved' needs virtual_stages >= 2, got "
                             f"{self.virtual_stages}; set virtual_stages or use schedule '1f1b'")
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            raise ConfigError(f"pipeline.virtual_stages = {self.virtual_stages} needs schedule 'interleaved', "
                             f"got {self.schedule!r}")
        mb = self.micro_batches
        if mb is not None and mb < 1:
            raise ConfigError(f"pipeline.micro_batches must be >= 1, got {mb}")
        if self.schedule == "interleaved" and mb is not None and mb % self.size != 0:
            raise ConfigError(f"pipeline.micro_batches ({mb}) must be a multiple of pipeline.size ({self.size}) "
                             "for the interleaved schedule (Narayanan et al. SC'21); change "
                             "gradient_accumulation_steps or the pipeline size")
        if isinstance(self.partition, list):
            b, chunks = self.partition, self.num_chunks
            if len(b) != chunks + 1 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
                raise ConfigError(f"pipeline.partition boundaries {b} must be {chunks + 1} strictly increasing "
                                 f"layer indices starting at 0 (size {self.size} x virtual_stages "
                                 f"{self.virtual_stages} = {chunks} chunks), e.g. [0, 4, 8] for 2 chunks of "
                                 "4 layers")


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
            raise ConfigError(f"nonfinite_guard.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}")


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
                raise ConfigError(f"comm.{key} = {value!r} is out of range: it must be a number of seconds > 0")


# ------------------------------------------------------------------------------------------------ the whole
@dataclass(frozen=True)
class PlaitConfig:
    """A resolved training configuration (ds_config keys plus plait's parallel sections).

    Batch sizes are in samples: ``train_batch_size = train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * dp`` (one optimizer step); ``data_parallel_size`` recovers dp.
    ``gradient_clipping`` is the max global L2 norm (0 = off). ``communication_data_type`` is the dtype of
    gradient reductions ("fp32", "fp16", "bf16"; None = fp32, plait's default). ``gradient_predivide_factor``
    divides gradients before the all-reduce and the rest after. ``seed`` seeds layout-invariant init.
    """

    train_batch_size: int = field(metadata={"auto": True})
    train_micro_batch_size_per_gpu: int = field(metadata={"auto": True})
    gradient_accumulation_steps: int = field(metadata={"auto": True})
    steps_per_print: int = 10
    gradient_clipping: float = _auto(0.0)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config, metadata={"aliases": ("bfloat16",)})
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    nonfinite_guard: NonFiniteGuardConfig = field(default_factory=NonFiniteGuardConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    zero_allow_untested_optimizer: bool = False
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
        if not (math.isfinite(self.gradient_clipping) and self.gradient_clipping >= 0):
            raise ConfigError(f"gradient_clipping = {self.gradient_clipping!r} is out of range: it must be a finite "
                              "number >= 0 (the max global gradient norm; 0 = off)")
        if self.gradient_predivide_factor <= 0:
            raise ConfigError(f"gradient_predivide_factor must be > 0, got {self.gradient_predivide_factor}")
        micro, gas, train = (self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps,
                             self.train_batch_size)
        if min(micro, gas, train) < 1 or train % (micro * gas) != 0:
            raise ConfigError(f"train_batch_size ({train}) must be a positive multiple of "
                             f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({gas})")
        mb = self.pipeline.micro_batches
        if mb is not None and mb != gas:
            raise ConfigError(f"pipeline.micro_batches ({mb}) differs from gradient_accumulation_steps ({gas}); "
                             "a pipeline step runs one micro-batch per accumulation step: make them equal")

    @property
    def data_parallel_size(self) -> int:
        """dp = train_batch_size / (micro-batch x gradient accumulation steps)."""
        return self.train_batch_size // (self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps)

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
