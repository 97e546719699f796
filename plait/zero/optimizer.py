"""ZeroOptimizer: ZeRO stages 0-3 over any ``nn.Module`` with fp32 master weights (Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC'20, Sec. 5).

It owns the flat parameter/gradient/master buffers, the gradient reduction during backward (stages 2-3),
the stage-3 gathers, and the optimizer step over the master shards (``plait.zero.stepper``; with offload,
``plait.zero.offload``). ``backward`` owns the 1/GAS scaling; an engine that runs autograd itself (pipeline
schedules) multiplies its loss by ``scale_loss``, calls ``note_micro_step()`` per micro-batch and ``step()``
at the end. The bytes held per stage and the lifecycle: ``docs/design.md`` ("ZeroOptimizer");
``memory_bytes()`` measures them.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from plait.parallel.collectives import group_rank, group_size
from plait.zero.assemble import (
    gatherer_of,
    layout_of,
    masters_of,
    optimizer_of,
    readiness_of,
    reducer_of,
    shard_set_of,
    stepper_of,
)
from plait.zero.build import check_arguments, weight_decay_groups
from plait.zero.clip import clip_coefficient
from plait.zero.comm import make_comms
from plait.zero.edits import gathered, mark_owner
from plait.zero.flat import rebind_views
from plait.zero.slices import ParamSlice, ShardState, load_shard_state, shard_state
from plait.zero.grads import weak_hook
from plait.zero.memory import held_bytes
from plait.zero.offload import OffloadOptions
from plait.zero.policy import ClipOptions, CommOptions, PrecisionOptions, StagePolicy
from plait.zero.precision import LossScaler, log_skipped_step
from plait.zero.stepper import Stepper, write_back

__all__ = [
    "ClipOptions",
    "CommOptions",
    "PrecisionOptions",
    "StagePolicy",
    "ZeroOptimizer",
    "weight_decay_groups",
]


class ZeroOptimizer:
    """Data-parallel ZeRO optimizer wrapping a torch optimizer class (see module docstring).

    Args:
        module: any ``nn.Module``; its trainable parameters are re-pointed into flat buffers (and
            cast to ``precision.param_dtype``); frozen parameters are left alone. Construct after moving the
            module to its device.
        dp_group: data-parallel ProcessGroup (e.g. ``mesh.dp_group``); None means one process
            (no communication; note None is *not* the world group here).
        expert_group: under expert parallelism, the expert-data-parallel group (``mesh.group("edp")``) that
            expert weights split over the ep ranks (``TPShard.axis == "ep"``) are sharded and reduced over.
        stage: 0 (plain DP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
        optimizer: torch optimizer class or factory ``f(param_groups, **optimizer_kwargs)``; it must
            be elementwise (Adam/AdamW/SGD...), or ``Lamb`` given its segments (``attach_lamb_segments``).
        optimizer_kwargs: defaults for every group (lr, betas, weight_decay, ...).
        param_groups: torch-style groups over ``module``'s parameters with per-group options (e.g.
            ``weight_decay_groups``); None: one group.
        precision: ``PrecisionOptions`` (compute dtype, fp16 loss scaler, non-finite guard); None: the
            defaults (parameters keep their dtype, inf/nan steps skipped).
        clip: ``ClipOptions`` (``max_grad_norm``, the tp/pp groups the norm spans, parameters it leaves
            out); None: no clipping, the norm over dp only.
        comm: ``CommOptions`` (reduce dtype, bucket sizes, overlap, stage-3 prefetch and persistence);
            None: the defaults.
        units: stage 3: modules gathered as one unit (e.g. transformer blocks); None: every module
            with parameters of its own (see ``stage3``).
        gradient_accumulation_steps: micro-steps per optimizer step (GAS).
        offload: ``OffloadOptions`` for ZeRO-Offload (``plait.zero.offload``): with ``optimizer`` the
            masters, gradient shards and optimizer state live on the host and ``optimizer`` must be
            torch.optim.Adam/AdamW or a ``HostOptimizer`` factory (stages 1-3); with ``param`` the
            stage-3 parameter shards live on the host. None: everything on the module's device.
        weights: a ``plait.zero.weights.WeightSource`` to fill the flat buffers from instead of the
            parameters' values (placeholders from ``place_meta_parameters``): under stage 3 each rank
            reads only its shard of each segment.

    Raises:
        ValueError: bad stage, sizes, param groups or option groups (message names the values and the fix).
    """

    def __init__(
        self,
        module: nn.Module,
        dp_group=None,
        *,
        expert_group=None,
        stage: int = 1,
        optimizer=torch.optim.AdamW,
        optimizer_kwargs: dict | None = None,
        param_groups: list[dict] | None = None,
        precision: PrecisionOptions | None = None,
        clip: ClipOptions | None = None,
        comm: CommOptions | None = None,
        units: list[nn.Module] | None = None,
        gradient_accumulation_steps: int = 1,
        offload: OffloadOptions | None = None,
        weights=None,
    ):
        self.policy = StagePolicy.of(stage)
        check_arguments(
            self.policy,
            gradient_accumulation_steps,
            offload,
            {
                "precision": (precision, PrecisionOptions),
                "clip": (clip, ClipOptions),
                "comm": (comm, CommOptions),
                "offload": (offload, OffloadOptions),
            },
        )
        self.module, self.stage, self.dp_group, self.comm = (
            module,
            stage,
            dp_group,
            comm or CommOptions(),
        )
        self.dp_size, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.comms = make_comms(dp_group, expert_group)
        self.offload_options, self._host = offload, offload is not None and offload.optimizer
        self.precision, self.clip = precision or PrecisionOptions(), clip or ClipOptions()
        self.gradient_accumulation_steps = gradient_accumulation_steps
        layout = layout_of(self, param_groups, self.precision.param_dtype, units)
        self.groups, self.units, self.params, self.device = (
            layout.groups,
            layout.units,
            layout.params,
            layout.device,
        )
        self.masters, self.grad_shards, self._land_dtype = masters_of(self, weights)
        self.optimizer, self._opt_index = optimizer_of(
            self, optimizer, optimizer_kwargs, layout.group_opts
        )
        fp16 = any(g.key.dtype == torch.float16 for g in self.groups)
        self.scaler = (
            self.precision.loss_scaler
            if self.precision.loss_scaler is not None
            else (LossScaler() if fp16 else None)
        )
        self._reset_counters()
        self._build_communication()

    def _reset_counters(self) -> None:
        self._in_backward = False
        self.micro_steps = 0  # micro-steps since the last optimizer step
        self.boundary_override: bool | None = (
            None  # set_gradient_accumulation_boundary (DeepSpeed API)
        )
        self.global_steps = 0  # optimizer steps applied
        self.skipped_steps = (
            0  # optimizer steps skipped for a non-finite gradient norm (fp16 overflow)
        )
        self.consecutive_skips = 0  # of them, in a row up to the last step
        self.grad_norm: float | None = (
            None  # global norm (unscaled, before clipping) of the last step
        )

    def _build_communication(self) -> None:
        """Stage-3 gatherer, gradient hooks, the stepper and the gradient reducer (``plait.zero.assemble``)."""
        ready = readiness_of(self)
        self.gatherer = gatherer_of(self, ready)
        on_grad = weak_hook(
            self._on_grad
        )  # a bound method in a C++ hook would keep this optimizer alive
        self._hooks = (
            [p.register_post_accumulate_grad_hook(on_grad) for p in self.params]
            if self.policy.gradients
            else []
        )
        self.shards = shard_set_of(self)
        self.stepper: Stepper = stepper_of(self, ready)
        self.reducer = reducer_of(self)
        mark_owner(self.params, self)

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's param groups (their ``params`` are the fp32 master shards): set
        ``lr`` here, or hand ``opt.optimizer`` to a torch LR scheduler."""
        return self.optimizer.param_groups

    # ---- backward -----------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without fp16 scaling)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """``loss * loss_scale / gradient_accumulation_steps`` in float32 (without the 1/GAS when
        ``scale_wrt_gas`` is False): what ``backward`` differentiates."""
        if not scale_wrt_gas:
            return loss.float() * self.loss_scale
        return loss.float() * (self.loss_scale / self.gradient_accumulation_steps)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> None:
        """Backward of one micro-batch's loss (mean over the micro-batch on this rank).

        Scales by the loss scale and 1/GAS; gradients are averaged over dp by the reduction, so the
        update equals one on the mean loss of the global batch when micro-batches are equal-sized.
        ``scale_wrt_gas=False`` (DeepSpeed's argument): a loss already normalized over the accumulated
        micro-batches, not divided by GAS.
        """
        self.scale_loss(loss, scale_wrt_gas).backward(retain_graph=retain_graph)
        self.note_micro_step()

    def note_micro_step(self) -> None:
        """Count one micro-batch (``backward`` does this; engines running autograd themselves call it)."""
        self.micro_steps += 1

    def is_gradient_accumulation_boundary(self) -> bool:
        """True once ``gradient_accumulation_steps`` micro-steps were counted since the last step
        (always with GAS 1, so engines that do not count micro-steps can call ``step()`` directly), unless
        ``boundary_override`` says otherwise (DeepSpeed's ``set_gradient_accumulation_boundary``)."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (
            self.gradient_accumulation_steps == 1
            or self.micro_steps >= self.gradient_accumulation_steps
        )

    def _last_micro_step(
        self,
    ) -> bool:  # during backward: whether this micro-step's gradients are final
        return self.micro_steps + 1 >= self.gradient_accumulation_steps or bool(
            self.boundary_override
        )

    def _note_backward(self) -> None:
        if not self._in_backward:
            self.synchronize()  # an overlapped offload step still reads the gradient shards
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, param: torch.Tensor) -> None:
        self._note_backward()
        self.reducer.on_grad(param)
        if self.gatherer is not None:
            self.gatherer.on_grad(param)

    def _end_backward(self) -> None:
        self._in_backward = False
        self.reducer.flush()
        if self.gatherer is not None:
            self.gatherer.end_backward()

    # ---- step -------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Apply one optimizer step at the accumulation boundary: reduce -> global norm over dp x tp x pp
        -> skip on every rank if inf/nan (``skip_nonfinite``; fp16 overflow) -> unscale and clip to
        ``max_grad_norm`` -> the stepper updates the fp32 masters and publishes the parameters -> finish.

        A non-finite norm is decided here, once, for both steppers: skipped with a loss scaler or
        ``PrecisionOptions(skip_nonfinite=True)``; otherwise applied with the gradients as they are
        (coefficient 1), inf/nan reaching the weights and ``grad_norm``. An offload early-mode step
        (``plait.zero.offload``), already applied during backward, is the same step.

        Returns:
            True when the parameters were updated; False before the boundary or when the step was
            skipped (the same on all ranks; fp16 also lowers the loss scale).

        Raises:
            LossScaleError: overflow with the loss scale already at ``min_loss_scale``.
        """
        if not self.is_gradient_accumulation_boundary():
            return False
        self.synchronize()  # a previous overlapped host step (plait.zero.offload) is finished
        if self.policy.gradients:
            self.reducer.wait()  # stages 2-3 reduced during backward
        else:
            self.reducer.reduce_all()  # stages 0-1 reduce at the boundary
        self.micro_steps = 0
        scale = self.loss_scale
        norm = self.stepper.grad_norm() / scale  # all-reduced: the same on every rank
        if math.isfinite(norm):
            coef = clip_coefficient(norm, self.clip.max_grad_norm) / scale
        elif self.precision.skip_nonfinite or self.scaler is not None:
            return self.skip_step(norm)  # inf/nan anywhere (fp16 overflow)
        else:
            coef = 1.0  # applied as is (no scaler here: the scale is 1)
        self.grad_norm = norm
        self.stepper.apply(coef)
        self.reducer.zero()
        if self.scaler is not None:
            self.scaler.update(False)
        self.global_steps += 1
        self.consecutive_skips = 0
        return True

    def skip_step(self, norm: float = math.nan) -> bool:
        """A non-finite gradient on some rank (``norm``: the global norm): drop this step's gradients on
        every rank, count and log the skip, and lower the fp16 loss scale (raises ``LossScaleError`` at
        the minimum). Returns False (not applied)."""
        self.stepper.discard()
        self.reducer.zero()
        self.grad_norm = None
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.scaler is not None:
            self.scaler.update(True)
        if (
            self.scaler is None or not self.scaler.dynamic
        ):  # a dynamic scale's overflows are routine
            log_skipped_step(self.global_steps + self.skipped_steps, norm, self.consecutive_skips)
        return False

    def synchronize(self) -> None:
        """Finish an offloaded optimizer step still running after ``step()`` returned (ZeRO-Offload
        ``overlap_step``, see ``plait.zero.offload``); a no-op otherwise. The next forward waits per
        segment by itself, and every method here that reads parameters or state calls this; call it
        before reading parameters any other way. Collective over dp while a step is in flight."""
        self.stepper.synchronize()

    def write_back(self) -> None:
        """Copy the fp32 masters into the model parameters (compute dtype); all-gather over dp
        where every rank holds whole parameters. Collective."""
        self.synchronize()
        write_back(
            self.groups,
            self.masters,
            self.comms,
            self.comm.allgather_bucket_size,
            self.comm.overlap_comm,
        )

    def rebind_views(self) -> None:
        """Point parameters back at their flat buffers where something replaced their ``.data``.

        A ``module.to(device)`` on an already-placed model (accelerate's ``prepare_model``, run by the
        Hugging Face Trainer's ``evaluate``) can hand parameters copies of their values, which later steps
        would not update. DeepSpeed's stage 1/2 re-points its parameters after every step for that reason."""
        rebind_views(self.groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (model ``.grad`` and the fp32 grad shards) and restart the
        accumulation count. ``step()`` already leaves them zero; call this only to discard work."""
        for p in self.params:
            p.grad = None
        self.stepper.discard()
        self.reducer.zero()
        self.micro_steps = 0

    # ---- stage 3 whole-parameter access, memory, checkpoints ------------------------------------
    @contextmanager
    def gathered_parameters(self, modifier_rank: int | None = None):
        """Context in which every parameter is whole (stage 3 gathers; stages 0-2 already are). Collective.

        With ``modifier_rank`` (a dp rank) the values that rank holds at exit become the parameters on
        every rank, fp32 master weights included (``plait.zero.edits``), as DeepSpeed's
        ``GatheredParameters(..., modifier_rank=r)``; without it edits are not kept (stage 3 drops the
        gathered copies and every stage's next step starts from the master weights).
        """
        with gathered(self, modifier_rank):
            yield

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind: ``params`` (model parameter storage, compute dtype;
        stage-3 shards, persistent and currently gathered params), ``grads`` (``param.grad`` tensors),
        ``grad_shards`` (reduced gradients: fp32; bf16 under offload at GAS 1), ``master`` (fp32 weights),
        ``optimizer_state`` (torch optimizer state tensors), and ``total``."""
        return held_bytes(self)

    def shard_state(self) -> ShardState:
        """This rank's fp32 master and optimizer-state slices per logical parameter (views, not
        copies), plus per-group scalars and counters; see ``plait.zero.slices.ShardState``."""
        self.synchronize()
        return shard_state(self)

    def load_shard_state(self, read, state: ShardState | None = None) -> None:
        """Restore from slices saved at any dp size / stage; see ``plait.zero.slices.load_shard_state``."""
        self.synchronize()
        load_shard_state(self, read, state)

    def param_slices(self) -> list[ParamSlice]:
        return self.shard_state().slices

    def close(self) -> None:
        """Remove every hook this optimizer put on the model (after a final ``gathered_parameters``
        export, for instance)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
        self.stepper.close()
