"""What a ZeRO stage partitions, and the option groups of ``ZeroOptimizer``: communication
(``CommOptions``), precision (``PrecisionOptions``) and the gradient norm and clipping (``ClipOptions``).

Rajbhandari et al., "ZeRO", SC'20, Sec. 5: stage 1 (P_os) partitions the optimizer states (here with
the fp32 master weights) over the N_d data-parallel ranks, stage 2 (P_os+g) also the gradients,
stage 3 (P_os+g+p) also the parameters; stage 0 is plain data parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.zero.clip import NormGroups
from plait.zero.precision import LossScaler, resolve_dtype


@dataclass(frozen=True)
class StagePolicy:
    """Which model states a ZeRO ``stage`` shards over dp; built once (``StagePolicy.of``).

    Attributes:
        stage: 0, 1, 2 or 3.
        optimizer_states: fp32 masters and optimizer state are sharded (stages 1-3); else every rank
            holds them whole and the gradient is all-reduced.
        gradients: gradients are reduce-scattered during backward, from parameter hooks, and no full
            gradient is kept (stages 2-3); else ``param.grad`` accumulates and is reduced at the boundary.
        parameters: compute-dtype parameters are sharded and all-gathered per unit around use (stage 3).
    """

    stage: int
    optimizer_states: bool
    gradients: bool
    parameters: bool

    @classmethod
    def of(cls, stage: int) -> StagePolicy:
        """Raises ValueError unless ``stage`` is 0, 1, 2 or 3."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        return cls(stage, stage >= 1, stage >= 2, stage == 3)

    def shard_world(self, dp_size: int, dp_rank: int) -> tuple[int, int]:
        """``(world, rank)`` the flat segments are split over: ``(1, 0)`` when nothing is sharded."""
        return (dp_size, dp_rank) if self.optimizer_states else (1, 0)


@dataclass(frozen=True)
class CommOptions:
    """Communication knobs of ``ZeroOptimizer`` (DeepSpeed's ``zero_optimization`` keys of the same names).

    Args:
        reduce_dtype: dtype gradients are reduced in ("fp32", "bf16", "fp16" or a torch dtype).
        reduce_bucket_size: elements per segment, i.e. per gradient reduce-scatter/all-reduce (>= 1).
        allgather_bucket_size: elements per coalesced parameter all-gather (>= 1).
        overlap_comm: asynchronous collectives (reduction overlaps backward; all-gathers overlap each other).
        prefetch_bucket_size: stage 3: elements all-gathered ahead of use, counted in whole units (the next
            unit is always taken whole, so the GPU holds two units' gathered parameters at a time, also with
            offload_param; 0: no prefetch, one unit).
        param_persistence_threshold: stage 3: parameters with fewer elements stay whole on every rank.
        reshard_after_forward: stage 3: release a unit's gathered parameters when its forward ends and
            gather them again for its backward; False keeps them gathered in between (``stage3.ParamGatherer``).
        gather_cast: stage 3: a ``plait.zero.gather_cast.GatherCast`` whose parameters the forward and
            backward gather narrow (float8 weights: ``plait.precision.float8_gather``); None: none.

    Raises:
        ValueError: a bucket size below 1 element.
    """

    reduce_dtype: torch.dtype | str = torch.float32
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    reshard_after_forward: bool = True
    gather_cast: object = None

    def __post_init__(self):
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1 element, got {getattr(self, name)}")
        object.__setattr__(self, "reduce_dtype", resolve_dtype(self.reduce_dtype))
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            object.__setattr__(self, name, int(getattr(self, name)))


@dataclass(frozen=True)
class PrecisionOptions:
    """Compute dtype, fp16 loss scaling and the non-finite guard of ``ZeroOptimizer``.

    Args:
        param_dtype: compute dtype of the model parameters ("fp32", "bf16", "fp16" or a torch dtype);
            None keeps each parameter's dtype. The fp32 master weights come from the original values.
        loss_scaler: a ``LossScaler``; None: dynamic (``LossScaler()``) when a parameter computes in fp16,
            none otherwise.
        skip_nonfinite: skip (on every rank) a step whose global gradient norm is inf or nan, in every
            precision; False applies it as is (``ZeroOptimizer.step``). A loss scaler always skips such a
            step and lowers the scale.

    Raises:
        ValueError: an unknown dtype, a ``loss_scaler`` that is not a ``LossScaler``, a non-bool
            ``skip_nonfinite`` (the value and the fix named).
    """

    param_dtype: torch.dtype | str | None = None
    loss_scaler: LossScaler | None = None
    skip_nonfinite: bool = True

    def __post_init__(self):
        if self.param_dtype is not None:
            try:
                object.__setattr__(self, "param_dtype", resolve_dtype(self.param_dtype))
            except ValueError as err:
                raise ValueError(
                    f"PrecisionOptions(param_dtype={self.param_dtype!r}): {err}"
                ) from None
        if self.loss_scaler is not None and not isinstance(self.loss_scaler, LossScaler):
            raise ValueError(
                f"PrecisionOptions(loss_scaler={self.loss_scaler!r}) must be a plait.zero.LossScaler "
                "or None (fp16 then gets a dynamic one); pass LossScaler(...)"
            )
        if not isinstance(self.skip_nonfinite, bool):
            raise ValueError(
                f"PrecisionOptions(skip_nonfinite={self.skip_nonfinite!r}) must be True or False"
            )


@dataclass(frozen=True)
class ClipOptions:
    """The global gradient norm of ``ZeroOptimizer`` (over dp x tp x pp) and clipping by it.

    Args:
        max_grad_norm: clip the global gradient norm to this (``torch.nn.utils.clip_grad_norm_``'s
            formula); 0 or None: no clipping (the norm is still computed: ``grad_norm``, overflow).
        norm_groups: ``NormGroups(tp=..., pp=...)``: the model-parallel groups the norm and the overflow
            flag span besides dp.
        norm_exclude: ids of parameters left out of the norm (a tied copy whose twin on another pipeline
            stage is already counted); kept as a frozenset.

    Raises:
        ValueError: ``max_grad_norm`` negative, inf/nan or not a number; ``norm_groups`` not a
            ``NormGroups``; ``norm_exclude`` not a collection of ints.
    """

    max_grad_norm: float | None = 0.0
    norm_groups: NormGroups = NormGroups()
    norm_exclude: frozenset[int] = frozenset()

    def __post_init__(self):
        clip = self.max_grad_norm
        if clip is not None and (
            isinstance(clip, bool)
            or not isinstance(clip, (int, float))
            or not math.isfinite(clip)
            or clip < 0
        ):
            raise ValueError(
                f"ClipOptions(max_grad_norm={clip!r}) must be a finite number >= 0; "
                "0 or None turns clipping off"
            )
        object.__setattr__(self, "max_grad_norm", float(clip or 0.0))
        if self.norm_groups is None:
            object.__setattr__(self, "norm_groups", NormGroups())
        if not isinstance(self.norm_groups, NormGroups):
            raise ValueError(
                f"ClipOptions(norm_groups={self.norm_groups!r}) must be a plait.zero.NormGroups; "
                "pass NormGroups(tp=mesh.tp_group, pp=mesh.pp_group)"
            )
        try:
            exclude = frozenset(self.norm_exclude or ())
        except TypeError:
            exclude = None
        if exclude is None or not all(isinstance(i, int) for i in exclude):
            raise ValueError(
                f"ClipOptions(norm_exclude={self.norm_exclude!r}) must be a collection of parameter "
                "ids (ints), e.g. {id(p) for p in tied_copies}"
            )
        object.__setattr__(self, "norm_exclude", exclude)
