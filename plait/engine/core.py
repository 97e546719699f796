"""``plait.initialize()`` and the ``Engine``: DeepSpeed's training API over plait's ZeRO, tensor and
pipeline parallelism.

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

import logging

import torch
import torch.distributed as dist
from torch import nn

from plait.engine.batch import batch_limits, check_micro_batch, to_half
from plait.config import ConfigError, PlaitConfig, load_config
from plait.engine.compile import compile_regions, compiled_backend, is_compiled
from plait.engine.context import check_context_parallel, shard_batch
from plait.engine.facts import EngineFacts
from plait.engine.guard import RunGuard
from plait.engine.ranks import check_ranks_agree, start_up, timeout_groups
from plait.engine.report import StepReport
from plait.engine.model import apply_activation_checkpointing, as_groups, loss_of, on_device, stage3_units
from plait.engine.moe import ExpertLayers
from plait.engine.offload import engine_optimizer, offload_options
from plait.fit.check import fit_config
from plait.engine.pipeline import check_pipeline, pipeline_train_step
from plait.engine.gc_schedule import CollectionSchedule
from plait.engine.monitor import build_monitors
from plait.layers.init import TIED_ATTR
from plait.optim.factory import (
    NO_OPTIMIZER,
    NoOptimizer,
    scheduler_from_config,
    scheduler_from_user,
)
from plait.optim.lamb import Lamb
from plait.optim.lamb_segments import attach_lamb_segments
from plait.parallel.launch import init_distributed, launcher_world_size, leave_at_exit
from plait.parallel.mesh import ParallelMesh
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.zero import (ClipOptions, CommOptions, LossScaler, NormGroups, PrecisionOptions, ZeroOptimizer,
                        weight_decay_groups)
from plait.zero.weights import prepare_weights
from plait.precision.float8 import convert_to_float8


class Engine(EngineFacts):
    """Training engine; build it with ``plait.initialize``. See the module docstring.

    Attributes:
        module: the wrapped model (its parameters live in ZeRO's flat buffers).
        optimizer: the ``ZeroOptimizer``. lr_scheduler: the schedule (or None).
        config: the resolved ``PlaitConfig``. mesh: the ``ParallelMesh``.
        pipeline: a ``PipelineParallel`` when the model is pipelined, else None.
    """

    def __init__(self, module: nn.Module, config: PlaitConfig, mesh: ParallelMesh, optimizer, lr_scheduler,
                 model_parameters, pipeline=None, weights=None, units=None):
        self.module, self.config, self.mesh, self.pipeline = module, config, mesh, pipeline
        if config.fp8.enabled:   # before compile traces the blocks and ZeRO collects the (kept) parameters
            convert_to_float8(module, config.fp8, mesh.device)
        if config.compile.on:   # first: a refused combination builds nothing
            self.compile(config.compile.backend, config.compile.kwargs)
        apply_activation_checkpointing(module, config.activation_checkpointing)
        z = config.zero_optimization
        offload = offload_options(config, pipeline, optimizer)
        if config.fp16.enabled:
            param_dtype = torch.float16
            f = config.fp16
            scaler = LossScaler(f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis,
                                f.min_loss_scale, f.consecutive_hysteresis)
        else:
            param_dtype, scaler = (torch.bfloat16 if config.bf16.enabled else None), None
        factory, kwargs, groups = engine_optimizer(config, optimizer, offload, mesh.device.type)
        if groups is None and model_parameters is not None:
            groups = as_groups(model_parameters)
        if groups is None:
            groups = weight_decay_groups(module, kwargs.get("weight_decay", 0.0))
            groups = [g for g in groups if g["params"]]
        reduce_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.communication_data_type,
                                                                            torch.float32)
        self.optimizer = ZeroOptimizer(
            module, mesh.group("dp_cp"), expert_group=mesh.group("edp") if mesh.ep > 1 else None,
            stage=z.stage, optimizer=factory, optimizer_kwargs=kwargs,
            param_groups=groups, comm=CommOptions(
                reduce_dtype=reduce_dtype,
                # a bucket size of 0 (the Hugging Face test configs): every gradient is reduced on its own, as DeepSpeed
                reduce_bucket_size=max(1, z.reduce_bucket_size), allgather_bucket_size=max(1, z.allgather_bucket_size),
                overlap_comm=z.overlap_comm, prefetch_bucket_size=z.stage3_prefetch_bucket_size,
                param_persistence_threshold=z.stage3_param_persistence_threshold,
                reshard_after_forward=z.reshard_after_forward),
            units=(units if units is not None else stage3_units(module)) if z.stage == 3 else None,
            gradient_accumulation_steps=config.gradient_accumulation_steps, offload=offload, weights=weights,
            precision=PrecisionOptions(param_dtype, scaler, skip_nonfinite=config.nonfinite_guard.enabled),
            clip=ClipOptions(config.gradient_clipping, NormGroups(tp=mesh.tp_group, pp=mesh.pp_group),
                             # a tied head copy (on another pipeline stage than its embedding) counts once
                             norm_exclude={id(p) for p in module.parameters() if getattr(p, TIED_ATTR, None)}))
        inner = self.optimizer.optimizer
        if isinstance(inner, Lamb):
            attach_lamb_segments(inner, self.optimizer, module, mesh)
        self.lr_scheduler = (scheduler_from_user(lr_scheduler, inner) if lr_scheduler is not None
                             else scheduler_from_config(config.scheduler, inner))
        self._step_applied, self.global_samples = False, 0
        limits = batch_limits(getattr(module[0] if pipeline is not None else module, "config", None))
        self.guard = RunGuard(self.optimizer, config, timeout_groups(mesh, pipeline), limits, mesh.device,
                              pipelined=pipeline is not None)
        self.report = StepReport(config.steps_per_print, config.wall_clock_breakdown, self.global_rank, mesh.device,
                                 config.gradient_accumulation_steps, build_monitors(config, self.global_rank))
        self.experts = ExpertLayers(module, mesh)   # mixture-of-experts layers (plait.engine.moe)
        self.collections = CollectionSchedule(config.garbage_collection.interval)   # last: it collects once

    @property
    def forward_only(self) -> bool:
        """Built without an optimizer (``plait.optim.factory.NoOptimizer``): forward passes only."""
        return isinstance(self.optimizer.optimizer, NoOptimizer)

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
            self._step_applied = False
            return
        self.guard.before_step()
        with self.report.timed("step"):
            self._step_applied = self.optimizer.step()
        self.global_samples += self.train_batch_size()
        self.guard.after_step(self._step_applied, self.global_steps)
        if self._step_applied:
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
                loss = loss_of(self.forward(**self._to_device(batch)))
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
        loss = sum(loss_of(self.forward(**self._to_device(b))).float() for b in batches) / len(batches)
        return self.dp_mean(loss)

    def _pull(self, data_iter, check: bool = False) -> list[dict]:
        """The step's ``gradient_accumulation_steps`` micro-batches. With a pipeline, or ``check`` (evaluation),
        each is checked (``plait.engine.batch``) and the verdict agreed over every rank before any computes; with a
        pipeline each is cut to this cp rank's chunks here, else in ``forward``."""
        it = data_iter if hasattr(data_iter, "__next__") else iter(data_iter)
        out, n, problem = [], self.config.gradient_accumulation_steps, None
        for i in range(n):
            try:
                batch = next(it)
            except StopIteration:
                raise ValueError(f"the data iterator ran out after {i} of the {n} micro-batches of step "
                                 f"{self.global_steps + 1} (gradient_accumulation_steps={n}); "
                                 "give train_batch an iterator with enough batches (or one that cycles)") from None
            if self.pipeline is not None or check:
                try:
                    batch = check_micro_batch(batch, self.guard.limits)
                except (TypeError, ValueError) as err:
                    problem = problem or err
            out.append(batch)
        if self.pipeline is not None or check:
            self.guard.agree(problem)
        return [shard_batch(b, self.mesh) for b in out] if self.pipeline is not None else out

    def _to_device(self, batch: dict) -> dict:
        device = self.mesh.device
        return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def dp_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over the data-parallel (x context-parallel) ranks (collective; the value
        itself at dp x cp 1), as a float32 tensor of shape ``[]`` on the engine's device (no host sync)."""
        group, size = self.mesh.group("dp_cp"), self.mesh.size("dp_cp")
        if group is None or size == 1:
            return loss
        out = loss.detach().to(self.mesh.device, torch.float32).reshape(1)
        dist.all_reduce(out, group=group)
        return (out / size).reshape(())

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
        if schedule is not None or compiled_autograd_enabled:
            raise ValueError("engine.compile: DeepCompile schedules and compiled autograd are not implemented; "
                             "call engine.compile(backend, compile_kwargs) without them")
        if self.pipeline is not None and str(self.pipeline.schedule).startswith("zb"):
            raise ConfigError(f"compile with pipeline schedule {self.pipeline.schedule!r}: a compiled block "
                              "is one autograd node, which the zero-bubble split would run whole in both its "
                              "input- and weight-gradient passes; use schedule '1f1b' or 'interleaved', or "
                              "compile off")
        before = compiled_backend(self.module)
        if before is not None and before != backend:
            logging.getLogger("plait").warning("engine.compile: the model is compiled with backend %r already; "
                                               "backend %r is not applied", before, backend)
        if self.config.compile.deepcompile:
            logging.getLogger("plait").warning(
                "config: compile.deepcompile = true is accepted: plait compiles each transformer block with "
                "torch.compile (its ZeRO hooks stay outside the compiled regions) instead of DeepCompile's passes")
        compile_regions(self.module, backend, compile_kwargs)

    @property
    def is_compiled(self) -> bool:
        """Whether ``compile`` compiled the model's blocks (DeepSpeed's ``engine.is_compiled``)."""
        return is_compiled(self.module)

    def gathered_parameters(self, modifier_rank: int | None = None):
        """Context in which every parameter is whole; with ``modifier_rank`` (a dp rank) that rank's
        edits become every rank's parameters, master weights included. Collective. See
        ``ZeroOptimizer.gathered_parameters``."""
        return self.optimizer.gathered_parameters(modifier_rank)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, async_save: bool = False,
                        keep_last: int | None = None):
        """Write a sharded, layout-free checkpoint (see ``plait.checkpoint``) as ``save_dir/tag``
        (default tag ``global_step<N>``) and point ``save_dir/latest`` at it; keep only the newest
        ``keep_last`` checkpoints. With ``async_save`` the tensors are copied to host and written in a
        background thread (the returned handle's ``wait()`` finishes it). Collective."""
        from plait.checkpoint.engine_io import save_engine
        with self.guard.startup_timeout():
            return save_engine(self, save_dir, tag, client_state or {}, async_save, keep_last)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, strict: bool = True,
                        allow_config_change: bool = False):
        """Load a checkpoint saved at any layout. Returns ``(path, client_state)``. Collective.
        A checkpoint of a model whose config computes differently (heads, activation, norm, ...) is
        refused with ``CheckpointError`` unless ``allow_config_change``."""
        from plait.checkpoint.engine_io import load_engine
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


def initialize(model, config, mesh: ParallelMesh | None = None, optimizer=None, lr_scheduler=None,
               model_parameters=None, weights=None, units=None, **config_facts) -> Engine:
    """Wrap ``model`` for training with ZeRO over the dp ranks (and tp/pp from ``mesh``).

    Args:
        model: any ``nn.Module`` (an unmodified Hugging Face model works), a plait model, or a
            ``PipelineParallel`` over this rank's stage chunks (``train_batch`` then runs its schedule;
            its ``micro_batches`` must equal ``gradient_accumulation_steps``). A model elsewhere is moved to
            the rank's device (its GPU when there is one). Under torchrun or SLURM with no process group
            yet, the job's group is started first (``init_distributed``).
        config: a ds_config path or dict (DeepSpeed key names), or a resolved ``PlaitConfig``.
        mesh: the ``ParallelMesh``; default: ``tensor_parallel.size`` x ``pipeline.size`` from the config
            over the initialized process group (or one process).
        optimizer: None (use the config's ``optimizer``), a torch optimizer class/factory, or an instance.
        lr_scheduler: None (use the config's ``scheduler``) or a factory ``f(optimizer) -> scheduler``.
        model_parameters: the parameters to train, exactly as given: an iterable of parameters (one group
            with the optimizer's options, weight decay on every one of them, as DeepSpeed) or torch param
            groups (dicts). None: plait's grouping (matrices decay; biases and norm weights do not).
        weights: for a model built under ``plait.zero.meta_parameters()`` (parameters on the meta device):
            a Hugging Face checkpoint folder (safetensors) or a ``plait.zero.weights.WeightSource``; under
            ZeRO-3 each rank reads only its shard of the parameters (``plait.zero.weights``).
        units: ZeRO-3's gather units, modules of ``model`` (the root gathers what none encloses); None: plait's
            choice (``plait.engine.model.stage3_units``: the blocks, and each other module with parameters).
        config_facts: extra facts for "auto" values (e.g. ``model_hidden_size``, ``lr``), see ``load_config``.

    Raises:
        ConfigError: unknown or inconsistent config keys (named, with the fix), or ranks started with
            different configs or models (the same message on every rank, naming keys, values and ranks).
        ValueError: parameters on the meta device without ``weights``, ``weights`` for a model whose
            parameters are not on the meta device, or a checkpoint tensor of another shape.
    """
    if not dist.is_initialized() and launcher_world_size() > 1:
        init_distributed()   # under torchrun/SLURM: join the job's group (each rank would train alone)
        leave_at_exit()
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)   # a Hugging Face model's, or plait's
    config_facts.setdefault("model_hidden_size", hidden)
    if mesh is None:
        raw = config if isinstance(config, PlaitConfig) else load_config(
            config, world_size=dist.get_world_size() if dist.is_initialized() else 1,
            **config_facts)
        check_ranks_agree(raw, model, None)   # before the mesh: every rank builds it from its config
        mesh = ParallelMesh(tp=raw.tensor_parallel.size, pp=raw.pipeline.size, cp=raw.context_parallel.size)
    if not isinstance(config, PlaitConfig):
        config = load_config(config, dp_size=mesh.dp, **config_facts)
    if config.tensor_parallel.size != mesh.tp or config.pipeline.size != mesh.pp:
        raise ConfigError(f"config asks for tensor_parallel.size={config.tensor_parallel.size}, pipeline.size="
                          f"{config.pipeline.size} but the mesh has tp={mesh.tp}, pp={mesh.pp}; make them agree")
    config = start_up(config, model, mesh)   # the ranks agree; comm.startup_timeout_s holds from here
    torch.manual_seed(config.seed)
    pipeline = None
    weights = prepare_weights(model, weights, mesh.device)
    config = fit_config(model, config, mesh.device, mesh.dp)   # before the model is moved: "auto" ratio, refusal
    model = on_device(model, mesh.device)
    if isinstance(model, PipelineParallel):
        pipeline, model = model, nn.ModuleList(model.stage_modules)
        check_pipeline(pipeline, config)
    check_context_parallel(config, mesh, model, pipeline)
    return Engine(model, config, mesh, optimizer, lr_scheduler, model_parameters, pipeline, weights, units)
