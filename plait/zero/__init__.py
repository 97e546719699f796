"""ZeRO data-parallel sharding (Rajbhandari et al., SC'20): stages 0-3, fp32 master weights,
fp16 loss scaling, global gradient-norm clipping over dp/tp/pp, and logical checkpoint slices."""

from plait.zero.clip import NormGroups, clip_coefficient, global_grad_norm
from plait.zero.slices import ParamSlice, ShardState, slices_reader
from plait.zero.grads import whole_gradients
from plait.zero.optimizer import (
    ClipOptions,
    CommOptions,
    PrecisionOptions,
    StagePolicy,
    ZeroOptimizer,
    weight_decay_groups,
)
from plait.zero.precision import LossScaleError, LossScaler, NonFiniteError, resolve_dtype
from plait.zero.weights import SafetensorsWeights, meta_parameters

__all__ = [
    "ClipOptions",
    "CommOptions",
    "LossScaleError",
    "LossScaler",
    "NonFiniteError",
    "NormGroups",
    "ParamSlice",
    "PrecisionOptions",
    "SafetensorsWeights",
    "ShardState",
    "StagePolicy",
    "ZeroOptimizer",
    "clip_coefficient",
    "global_grad_norm",
    "meta_parameters",
    "resolve_dtype",
    "slices_reader",
    "weight_decay_groups",
    "whole_gradients",
]
