"""The ``Engine`` that ``plait.initialize()`` builds: DeepSpeed's training API (and its read-side members,
under DeepSpeed's names and meanings) over plait's ZeRO, tensor and pipeline parallelism.

    engine = plait.initialize(model, "ds_config.json", mesh=mesh)
    for batch in loader:                       # without a pipeline
        loss = engine(**batch)
        engine.backward(loss)                  # x loss scale / GAS; ZeRO-2/3 reduce during backward
        engine.step()                          # applies at the accumulation boundary
    loss = engine.train_batch(data_iter)       # GAS micro-batches (through the pipeline when pp > 1)
    engine.save_checkpoint("ckpt")             # sharded safetensors; loads into any layout

Differences from ``deepspeed.initialize``: it returns the engine alone (not a 4-tuple), and a user
learning-rate schedule is passed as a factory ``f(optimizer)`` because ZeRO builds its own optimizer
over the fp32 master shards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.checkpoint.contract import Checkpointable, RngState, TrainerState, WriterSlot
from plait.checkpoint.engine_io import load_engine, save_engine
from plait.config import ConfigError, PlaitConfig
from plait.engine.batch import batch_limits, to_half
from plait.engine.compile import compile_engine_model, is_compiled
from plait.engine.context import shard_batch
from plait.engine.gc_schedule import CollectionSchedule
from plait.engine.guard import RunGuard
from plait.engine.model import apply_activation_checkpointing, loss_of, to_device
from plait.engine.moe import ExpertLayers
from plait.engine.monitor import build_monitors
from plait.engine.optimizer import lr_schedule, zero_optimizer
from plait.engine.pipeline import pipeline_train_step
from plait.engine.ranks import dp_mean, timeout_groups
from plait.engine.report import StepReport
from plait.engine.rng import load_rng_state, rng_state
from plait.optim.factory import NO_OPTIMIZER, NoOptimizer
from plait.parallel.launch import launch_info
from plait.parallel.mesh import ParallelMesh
from plait.precision.float8 import convert_to_float8


class Engine(Checkpointable):
    """Training engine; build it with ``plait.initialize``. See the module docstring. It implements
    ``plait.checkpoint.Checkpointable`` (what ``save_checkpoint``/``load_checkpoint`` save and load into).

    Attributes:
        module: the wrapped model (its parameters live in ZeRO's flat buffers).
        optimizer: the ``ZeroOptimizer``. lr_scheduler: the schedule (or None).
        config: the resolved ``PlaitConfig``. mesh: the ``ParallelMesh``.
        pipeline: a ``PipelineParallel`` when the model is pipelined, else None.
        step_applied: whether the last ``step()`` applied the update (``was_step_applied()``).
        data_loader: None, or a loader with ``state_dict``/``load_state_dict`` (set by the user) whose
            position checkpoints keep. checkpoint_writer: the ``WriterSlot`` saves write through.
        global_samples: samples of every optimizer step so far (``train_batch_size()`` each).

    Counters follow DeepSpeed (``deepspeed.runtime.engine.DeepSpeedEngine``): ``global_steps`` counts every
    optimizer step taken at an accumulation boundary, applied or skipped (an fp16 overflow, a non-finite
    gradient); ``skipped_steps`` counts the skipped ones; the schedule advances only on applied steps.
    """

    def __init__(self, module: nn.Module, config: PlaitConfig, mesh: ParallelMesh, optimizer, lr_scheduler,
                 model_parameters, pipeline=None, weights=None, units=None):
        self.module, self.config, self.mesh, self.pipeline = module, config, mesh, pipeline
        if config.fp8.enabled:   # before compile traces the blocks and ZeRO collects the (kept) parameters
            convert_to_float8(module, config.fp8, mesh.device)
        if config.compile.on:   # first: a refused combination builds nothing
            self.compile(config.compile.backend, config.compile.kwargs)
        apply_activation_checkpointing(module, config.activation_checkpointing)
        self.optimizer = zero_optimizer(module, config, mesh, optimizer, model_parameters, pipeline, weights, units)
        self.lr_scheduler = lr_schedule(config, lr_scheduler, self.optimizer.optimizer)
        self.step_applied, self.global_samples = False, 0
        limits = batch_limits(getattr(module[0] if pipeline is not None else module, "config", None))
        self.guard = RunGuard(self.optimizer, config, timeout_groups(mesh, pipeline), limits, mesh.device,
                              pipelined=pipeline is not None)
        self.report = StepReport(config.steps_per_print, config.wall_clock_breakdown, self.global_rank, mesh.device,
                                 config.gradient_accumulation_steps, build_monitors(config, self.global_rank))
        self.experts = ExpertLayers(module, mesh)   # mixture-of-experts layers (plait.engine.moe)
        self.data_loader = None   # a loader with state_dict/load_state_dict whose position checkpoints keep
        self.checkpoint_writer = WriterSlot()
        self.collections = CollectionSchedule(config.garbage_collection.interval)   # last: it collects once

    @property
    def forward_only(self) -> bool:
        """Built without an optimizer (``plait.optim.factory.NoOptimizer``): forward passes only."""
        return isinstance(self.optimizer.optimizer, NoOptimizer)

    # ---- model access ---------------------------------------------------------------------------------
    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def zero_grad(self) -> None:
        """Discard accumulated gradients and restart the accumulation count (``step`` already does)."""
        self.optimizer.zero_grad()

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        return self.mesh.device

    @property
    def local_rank(self) -> int:
        """This process's index on its node (torchrun's ``LOCAL_RANK`` or SLURM's ``SLURM_LOCALID``; 0 without)."""
        return launch_info().local_rank

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def dp_world_size(self) -> int:
        return self.mesh.dp

    # ---- counters ---------------------------------------------------------------------------------
    @property
    def global_steps(self) -> int:
        """Optimizer steps taken at accumulation boundaries, skipped ones included (DeepSpeed's count)."""
        return self.optimizer.global_steps + self.optimizer.skipped_steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient norm (fp16 overflow, or the nonfinite guard)."""
        return self.optimizer.skipped_steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches since the last optimizer step."""
        return self.optimizer.micro_steps

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last applied step."""
        return self.optimizer.grad_norm

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.grad_norm

    def moe_stats(self) -> dict | None:
        """Mixture-of-experts statistics since the last call: ``aux_loss``, ``load_imbalance`` (max/mean
        tokens per expert, the worst layer) and ``dropped`` (``plait.engine.moe.ExpertLayers.stats``);
        None for a model without expert layers. Collective: every rank calls it."""
        return self.experts.stats()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Per group: Adam's ``betas`` or SGD's ``momentum`` (None when the optimizer has neither)."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` applied the update (False off the boundary and for a skipped step)."""
        return self.step_applied

    # ---- configuration facts ----------------------------------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the accumulation boundary (DeepSpeed's API): ``True`` makes the next ``step()`` apply
        after however many micro-batches were accumulated (an epoch's short last accumulation: the
        gradient is then the sum of those micro-batches' losses / GAS, as in DeepSpeed); ``False``
        holds the step back; ``None`` returns to counting micro-batches. It stays until changed."""
        self.optimizer.boundary_override = None if is_boundary is None else bool(is_boundary)

    # ---- DeepSpeed's training API -------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """The model's forward. ``input_ids``/``labels``/``position_ids`` keyword tensors are screened first
        (``plait.engine.batch.screen_micro_batch``: the verdict is agreed over every rank at the accumulation boundary);
        with ``fp16.auto_cast`` floating-point inputs are cast to fp16 first, as DeepSpeed does."""
        kwargs = shard_batch(self.guard.screen(kwargs), self.mesh, args)   # context parallel: this rank's chunks
        self.optimizer.rebind_views()
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = to_half(args), to_half(kwargs)
        # mixture-of-experts layers join their losses to the gradient scaled as backward scales the loss
        opt = self.optimizer
        kwargs = self.experts.forward_kwargs(kwargs, opt.loss_scale / opt.gradient_accumulation_steps)
        with self.report.timed("forward"):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-batch's mean loss, scaled by the loss scale and 1/GAS (``scale_wrt_gas=False``,
        DeepSpeed's argument: not by 1/GAS, for a loss already normalized over the accumulated micro-batches).

        Raises:
            ValueError: ``loss`` is not a scalar (a model given no ``labels`` returns its logits).
        """
        if not torch.is_tensor(loss) or loss.dim() != 0:
            shape = list(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
            raise ValueError(f"engine.backward needs the micro-batch's scalar mean loss, got {shape}; a model given "
                             "no 'labels' returns its logits: put the labels in the batch")
        if self.forward_only:
            raise ConfigError(NO_OPTIMIZER)
        self.guard.loss = loss.detach()
        self.report.add_micro_loss(loss)
        with self.report.timed("backward"):
            self.optimizer.backward(loss, scale_wrt_gas=scale_wrt_gas)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.optimizer.is_gradient_accumulation_boundary()

    def step(self) -> None:
        """Optimizer (and schedule) step at the accumulation boundary; a no-op before it.
        A non-finite global gradient norm (fp16 overflow, a nan/inf gradient in any precision) skips the
        step on every rank and does not advance the schedule.

        Raises:
            ValueError: a bad micro-batch of this step on any rank (every rank raises it, with nothing applied).
            NonFiniteError: ``nonfinite_guard.max_consecutive_skips`` steps in a row were skipped (fp32/bf16;
                fp16 with a loss scale that cannot recover).
        """
        if self.forward_only:
            raise ConfigError(NO_OPTIMIZER)
        if not self.is_gradient_accumulation_boundary():
            self.step_applied = False
            return
        self.guard.before_step()
        with self.report.timed("step"):
            self.step_applied = self.optimizer.step()
        self.global_samples += self.train_batch_size()
        self.guard.after_step(self.step_applied, self.global_steps)
        if self.step_applied:
            self.experts.after_step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.report.after_step(global_steps=self.global_steps, global_samples=self.global_samples,
                               skipped_steps=self.skipped_steps, lrs=self.get_lr(), moms=self.get_mom(),
                               loss_scale=self.loss_scale if self.config.fp16.enabled else None)
        self.collections.after_step(self.global_steps)   # applied and skipped steps, as every rank counts

    def train_batch(self, data_iter) -> torch.Tensor:
        """One optimizer step over a global batch: GAS micro-batches pulled from ``data_iter`` (dicts of
        model inputs with ``labels``), through the pipeline's schedule when there is one.

        Returns:
            The mean loss over the micro-batches and the dp ranks: a float32 tensor of shape ``[]`` on the
            engine's device (``mesh.device``). It stays there (no host sync) until read, e.g. ``float(loss)``.
        """
        batches = self._pull(data_iter)
        if self.pipeline is not None:
            loss = pipeline_train_step(self.pipeline, self.optimizer, batches)
            self.guard.loss = loss.detach()
            self.report.set_step_loss(loss)
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
            for batch in batches:
                loss = loss_of(self.forward(**to_device(batch, self.mesh.device)))
                self.backward(loss)
                total += loss.detach().float()
            loss = total / self.config.gradient_accumulation_steps
        self.step()
        return self.dp_mean(loss)

    @torch.no_grad()
    def eval_batch(self, data_iter) -> torch.Tensor:
        """Mean loss over GAS micro-batches, forward only (through the pipeline when pp > 1); the same type
        as ``train_batch``'s (float32, shape ``[]``, on the device)."""
        batches = self._pull(data_iter, check=True)
        if self.pipeline is not None:
            return self.dp_mean(self.pipeline.eval_batch(iter(batches)))
        loss = sum(loss_of(self.forward(**to_device(b, self.mesh.device))).float() for b in batches) / len(batches)
        return self.dp_mean(loss)

    def _pull(self, data_iter, check: bool = False) -> list[dict]:
        """The step's micro-batches (``RunGuard.pull``), checked with a pipeline or ``check`` (evaluation); with a
        pipeline each is cut to this cp rank's chunks here, else in ``forward``."""
        n, pipelined = self.config.gradient_accumulation_steps, self.pipeline is not None
        out = self.guard.pull(data_iter, n, self.global_steps + 1, check=pipelined or check)
        return [shard_batch(b, self.mesh) for b in out] if pipelined else out

    def dp_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """``plait.engine.ranks.dp_mean`` over this engine's mesh."""
        return dp_mean(loss, self.mesh)

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` each transformer block in place, the engine's
        hooks outside (``plait.engine.compile``); the ds_config's ``compile`` section calls it from
        ``initialize``. A second call is a no-op.

        Raises:
            ValueError: a DeepCompile ``schedule`` or ``compiled_autograd_enabled`` (not implemented: the
                backward of each compiled block is compiled already), or ``backend`` inside ``compile_kwargs``.
            ConfigError: a zero-bubble pipeline schedule (its split backward cannot split a compiled block).
        """
        compile_engine_model(self.module, self.pipeline, backend, compile_kwargs, schedule, compiled_autograd_enabled,
                             self.config.compile.deepcompile)

    @property
    def is_compiled(self) -> bool:
        """Whether ``compile`` compiled the model's blocks (DeepSpeed's ``engine.is_compiled``)."""
        return is_compiled(self.module)

    def gathered_parameters(self, modifier_rank: int | None = None):
        """Context in which every parameter is whole; with ``modifier_rank`` (a dp rank) that rank's
        edits become every rank's parameters, master weights included. Collective. See
        ``ZeroOptimizer.gathered_parameters``."""
        return self.optimizer.gathered_parameters(modifier_rank)

    # ---- checkpoints (plait.checkpoint.Checkpointable) ------------------------------------------------
    def model_chunks(self) -> list[nn.Module]:
        """This rank's model chunks: the pipeline's stage modules, else the model."""
        return list(self.pipeline.stage_modules) if self.pipeline is not None else [self.module]

    def trainer_state(self) -> TrainerState:
        """Samples so far, the schedule's and the ``data_loader``'s states, and the resolved config."""
        sched, loader = self.lr_scheduler, self.data_loader
        return TrainerState(self.global_samples, sched.state_dict() if sched is not None else None,
                            self.config.to_dict(), loader.state_dict() if hasattr(loader, "state_dict") else None)

    def load_trainer_state(self, state: TrainerState) -> None:
        """Take a checkpoint's counters and schedule and ``data_loader`` states (None fields: keep ours)."""
        if state.global_samples is not None:
            self.global_samples = state.global_samples
        if state.lr_scheduler is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state.lr_scheduler)
        if state.data_loader is not None and hasattr(self.data_loader, "load_state_dict"):
            self.data_loader.load_state_dict(state.data_loader)

    def rng_state(self) -> RngState:
        """torch's CPU and (on a GPU) CUDA generators, and each chunk's tensor-parallel RNG tracker."""
        return rng_state(self.model_chunks(), self.mesh.device)

    def load_rng_state(self, state: RngState) -> None:
        load_rng_state(self.model_chunks(), self.mesh.device, state)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, async_save: bool = False,
                        keep_last: int | None = None):
        """Write a sharded, layout-free checkpoint (see ``plait.checkpoint``) as ``save_dir/tag``
        (default tag ``global_step<N>``) and point ``save_dir/latest`` at it; keep only the newest
        ``keep_last`` checkpoints. With ``async_save`` the tensors are copied to host and written in a
        background thread (the returned handle's ``wait()`` finishes it). Collective."""
        with self.guard.startup_timeout():
            return save_engine(self, save_dir, tag, client_state or {}, async_save, keep_last)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, strict: bool = True,
                        allow_config_change: bool = False):
        """Load a checkpoint saved at any layout. Returns ``(path, client_state)``. Collective.
        A checkpoint of a model whose config computes differently (heads, activation, norm, ...) is
        refused with ``CheckpointError`` unless ``allow_config_change``."""
        with self.guard.startup_timeout():
            return load_engine(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, strict,
                               allow_config_change)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model's weights in the compute dtype as one file from rank 0 (DeepSpeed's method; see
        ``plait.checkpoint.export16``). Returns False under ZeRO-3 unless
        ``stage3_gather_16bit_weights_on_model_save``. Collective."""
        from plait.checkpoint.export16 import save_16bit
        return save_16bit(self, save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model
