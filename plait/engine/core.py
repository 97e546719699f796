"""The ``Engine`` that ``plait.initialize()`` builds: DeepSpeed's training API (and its read-side members,
under DeepSpeed's names and meanings) over plait's ZeRO, tensor and pipeline parallelism.

    engine = plait.initialize(model, "ds_config.json", mesh=mesh)
    for batch in loader:                       # without a pipeline
        loss = engine(**batch)
        engine.backward(loss)                  # x loss scale / GAS; ZeRO-2/3 reduce during backward
        engine.step()                          # applies at the accumulation boundary
    loss = engine.train_batch(data_iter)       # GAS micro-batches (through the pipeline when pp > 1)
    engine.save_checkpoint("ckpt")             # sharded safetensors; loads into any layout

``plait.initialize`` (``plait.engine.build``) differs from ``deepspeed.initialize`` as that module says.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.checkpoint.contract import Checkpointable, RngState, TrainerState, WriterSlot
from plait.checkpoint.engine_io import load_engine, save_engine
from plait.checkpoint.export16 import save_16bit
from plait.config import ConfigError, PlaitConfig
from plait.engine.batch import batch_limits
from plait.engine.compile import compile_engine_model, is_compiled
from plait.engine.gc_schedule import CollectionSchedule
from plait.engine.guard import RunGuard
from plait.engine import loop
from plait.engine.model import apply_activation_checkpointing
from plait.engine.moe import ExpertLayers
from plait.engine.monitor import build_monitors
from plait.engine.optimizer import lr_schedule, zero_optimizer
from plait.engine.ranks import dp_mean, timeout_groups
from plait.engine.report import StepReport
from plait.engine.state import load_rng_state, load_trainer_state, rng_state, trainer_state
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

    def __init__(
        self,
        module: nn.Module,
        config: PlaitConfig,
        mesh: ParallelMesh,
        optimizer,
        lr_scheduler,
        model_parameters,
        pipeline=None,
        weights=None,
        units=None,
    ):
        self.module, self.config, self.mesh, self.pipeline = module, config, mesh, pipeline
        if (
            config.fp8.enabled
        ):  # before compile traces the blocks and ZeRO collects the (kept) parameters
            convert_to_float8(module, config.fp8, mesh.device)
        if config.compile.on:  # first: a refused combination builds nothing
            self.compile(config.compile.backend, config.compile.kwargs)
        apply_activation_checkpointing(module, config.activation_checkpointing)
        self.optimizer = zero_optimizer(
            module, config, mesh, optimizer, model_parameters, pipeline, weights, units
        )
        self.lr_scheduler = lr_schedule(config, lr_scheduler, self.optimizer.optimizer)
        self.step_applied, self.global_samples = False, 0
        limits = batch_limits(
            getattr(module[0] if pipeline is not None else module, "config", None)
        )
        self.guard = RunGuard(
            self.optimizer,
            config,
            timeout_groups(mesh, pipeline),
            limits,
            mesh.device,
            pipelined=pipeline is not None,
        )
        self.report = StepReport(
            config.steps_per_print,
            config.wall_clock_breakdown,
            self.global_rank,
            mesh.device,
            config.gradient_accumulation_steps,
            build_monitors(config, self.global_rank),
        )
        self.experts = ExpertLayers(module, mesh)  # mixture-of-experts layers (plait.engine.moe)
        self.data_loader = (
            None  # a loader with state_dict/load_state_dict whose position checkpoints keep
        )
        self.checkpoint_writer = WriterSlot()
        self.gathers_16bit_on_save = config.zero_optimization.gathers_16bit_on_save
        self.collections = CollectionSchedule(
            config.garbage_collection.interval
        )  # last: it collects once

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
        """Mixture-of-experts statistics since the last call (``aux_loss``, ``load_imbalance``, ``dropped``:
        ``plait.engine.moe.ExpertLayers.stats``); None without expert layers. Collective."""
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
        args, kwargs = loop.model_inputs(self, args, kwargs)
        with self.report.timed("forward"):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-batch's mean loss, scaled by the loss scale and 1/GAS (``scale_wrt_gas=False``,
        DeepSpeed's argument: not by 1/GAS, for a loss already normalized over the accumulated micro-batches).

        Raises:
            ValueError: ``loss`` is not a scalar (a model given no ``labels`` returns its logits).
        """
        loop.micro_backward(self, loss, scale_wrt_gas)

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
        self.step_applied = loop.optimizer_step(self)
        self.global_samples += self.train_batch_size()
        loop.after_step(self)

    def train_batch(self, data_iter) -> torch.Tensor:
        """One optimizer step over a global batch: GAS micro-batches pulled from ``data_iter`` (dicts of
        model inputs with ``labels``), through the pipeline's schedule when there is one.

        Returns:
            The mean loss over the micro-batches and the dp ranks: a float32 tensor of shape ``[]`` on the
            engine's device (``mesh.device``). It stays there (no host sync) until read, e.g. ``float(loss)``.
        """
        return loop.train_batch(self, data_iter)

    def eval_batch(self, data_iter) -> torch.Tensor:
        """Mean loss over GAS micro-batches, forward only (through the pipeline when pp > 1); the same type
        as ``train_batch``'s (float32, shape ``[]``, on the device)."""
        return loop.eval_batch(self, data_iter)

    def dp_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """``plait.engine.ranks.dp_mean`` over this engine's mesh."""
        return dp_mean(loss, self.mesh)

    def compile(
        self,
        backend: str = "inductor",
        compile_kwargs: dict | None = None,
        schedule=None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` each transformer block in place, the engine's
        hooks outside; the ds_config's ``compile`` section calls it from ``initialize``. A second call is a
        no-op. Errors: ``plait.engine.compile.compile_engine_model``."""
        compile_engine_model(
            self.module,
            self.pipeline,
            backend,
            compile_kwargs,
            schedule,
            compiled_autograd_enabled,
            self.config.compile.deepcompile,
        )

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
        return trainer_state(
            self.global_samples, self.lr_scheduler, self.config.to_dict(), self.data_loader
        )

    def load_trainer_state(self, state: TrainerState) -> None:
        """Take a checkpoint's counters and schedule and ``data_loader`` states (None fields: keep ours)."""
        if state.global_samples is not None:
            self.global_samples = state.global_samples
        load_trainer_state(state, self.lr_scheduler, self.data_loader)

    def rng_state(self) -> RngState:
        """torch's CPU and (on a GPU) CUDA generators, and each chunk's tensor-parallel RNG tracker."""
        return rng_state(self.model_chunks(), self.mesh.device)

    def load_rng_state(self, state: RngState) -> None:
        load_rng_state(self.model_chunks(), self.mesh.device, state)

    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state=None,
        async_save: bool = False,
        keep_last: int | None = None,
    ):
        """Write a sharded, layout-free checkpoint (see ``plait.checkpoint``) as ``save_dir/tag``
        (default tag ``global_step<N>``) and point ``save_dir/latest`` at it; keep only the newest
        ``keep_last`` checkpoints. With ``async_save`` the tensors are copied to host and written in a
        background thread (the returned handle's ``wait()`` finishes it). Collective."""
        with self.guard.startup_timeout():
            return save_engine(self, save_dir, tag, client_state or {}, async_save, keep_last)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        strict: bool = True,
        allow_config_change: bool = False,
    ):
        """Load a checkpoint saved at any layout. Returns ``(path, client_state)``. Collective.
        A checkpoint of a model whose config computes differently (heads, activation, norm, ...) is
        refused with ``CheckpointError`` unless ``allow_config_change``."""
        with self.guard.startup_timeout():
            return load_engine(
                self,
                load_dir,
                tag,
                load_optimizer_states,
                load_lr_scheduler_states,
                strict,
                allow_config_change,
            )

    def save_16bit_model(
        self,
        save_dir,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """The whole model's weights in the compute dtype as one file from rank 0 (DeepSpeed's method; see
        ``plait.checkpoint.export16``). Returns False under ZeRO-3 unless
        ``stage3_gather_16bit_weights_on_model_save``. Collective."""
        return save_16bit(self, save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model
