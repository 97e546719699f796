"""``plait.accelerate.Accelerator``: accelerate's ``Accelerator`` with plait's engine where DeepSpeed's would be.

With a ``DeepSpeedPlugin`` (``deepspeed_plugin=``, or ``accelerate launch``'s ``ACCELERATE_USE_DEEPSPEED`` /
``ACCELERATE_DEEPSPEED_*`` environment) ``prepare``, ``backward``, ``clip_grad_norm_``, ``save_state`` /
``load_state``, ``unwrap_model``, ``get_state_dict`` and ``save_model`` do what accelerate's DeepSpeed path
does, on one plait engine; every other method, and all of it without a plugin, is accelerate's own.
``clip_grad_norm_`` returns the step's norm and refuses a ``max_norm`` other than the config's
``gradient_clipping``; precision is the ds_config's.

fp8 (``mixed_precision="fp8"``, accelerate's torchao backend ``AORecipeKwargs``) becomes the ds_config's
``fp8`` section (``plait.accelerate.fp8``).

Refused, naming the feature: several plugins, fp8 through TransformerEngine / MS-AMP,
``transformer_moe_cls_names``, ``device_placement`` lists, two models, ``backward`` keyword arguments,
``clip_grad_value_``. Each method's behaviour: ``docs/accelerate.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os

import accelerate
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin, DynamoBackend, parse_choice_from_env
from accelerate.utils.constants import MODEL_NAME
from accelerate.utils.dataclasses import FP8BackendType
from torch.utils.data import DataLoader

from plait.accelerate import ds_prepare, fp8
from plait.checkpoint.export16 import gathered_state_dict
from plait.config import ConfigError
from plait.parallel import launch

log = logging.getLogger("plait")


class DeepSpeedState(AcceleratorState):
    """accelerate's (shared) ``AcceleratorState`` that names the plugin and reads the precision from its ds_config,
    as under DeepSpeed (scripts ask ``accelerator.state.deepspeed_plugin``); the state accelerate itself runs on
    is unchanged."""

    def __init__(self, plugin: DeepSpeedPlugin):
        super().__init__()
        self._plait_plugin = plugin

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin:
        return self._plait_plugin

    @property
    def mixed_precision(self) -> str:
        config = self._plait_plugin.deepspeed_config
        if config.get("fp8", {}).get("enabled") is True:
            return "fp8"  # as accelerate's state under DeepSpeed with fp8
        for name in ("fp16", "bf16"):
            if config.get(name, {}).get("enabled") is True:
                return name
        return "no"


class Accelerator(accelerate.Accelerator):
    """accelerate's ``Accelerator`` (same arguments, keyword only) with plait's engine for DeepSpeed (see the
    module docstring and ``docs/accelerate.md``).

    Attributes:
        engine: the ``plait.engine.Engine`` once ``prepare`` has built it (None before, and without a plugin).
        fp8_request: accelerate's fp8 request read (``plait.accelerate.fp8.Fp8Request``), written into the
            ds_config's ``fp8`` section by ``prepare``; None without fp8 or without a plugin.

    Raises:
        ConfigError: a feature plait does not serve (named).
    """

    def __init__(
        self, *, deepspeed_plugin=None, deepspeed_plugins=None, mixed_precision=None, **kwargs
    ):
        if deepspeed_plugin is not None and deepspeed_plugins is not None:
            raise ValueError("You cannot pass in both `deepspeed_plugins` and `deepspeed_plugin`.")
        plugin = _plugin(deepspeed_plugin if deepspeed_plugin is not None else deepspeed_plugins)
        self.engine = None
        self.fp8_request = None
        if plugin is None:
            super().__init__(mixed_precision=mixed_precision, **kwargs)
            return
        precision = (
            mixed_precision or parse_choice_from_env("ACCELERATE_MIXED_PRECISION", "no")
        ).lower()
        recipes, kwargs["kwargs_handlers"] = fp8.split_handlers(kwargs.get("kwargs_handlers"))
        self.fp8_request = fp8.request(precision, recipes, bool(plugin.enable_msamp))
        if plugin.transformer_moe_cls_names or os.environ.get(
            "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"
        ):
            raise ConfigError(
                "plait.accelerate: transformer_moe_cls_names (ZeRO-3 leaf modules) is not served; plait "
                "gathers a ZeRO-3 model by its transformer blocks: drop it"
            )
        if plugin.zero3_init_flag:
            log.info(
                "zero3_init_flag: the model is built whole and partitioned in prepare() (to build it without "
                "weights, use plait.hf.from_pretrained)"
            )
        plugin.set_mixed_precision(precision)
        # accelerate would import deepspeed for the first, and read the second as its own fp8 backend
        with _without_env("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_FP8_BACKEND"):
            super().__init__(mixed_precision="no", **kwargs)  # the ds_config carries the precision
        self.state = DeepSpeedState(plugin)

    @property
    def fp8_backend(self) -> FP8BackendType:
        """With a plugin: AO when accelerate's fp8 was asked (plait's engine converts), else NO."""
        if self.deepspeed_plugin is None:
            return super().fp8_backend
        return FP8BackendType.AO if self.fp8_request is not None else FP8BackendType.NO

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        """The ``DeepSpeedPlugin`` whose ds_config the engine reads (None without one)."""
        return self.state.deepspeed_plugin if isinstance(self.state, DeepSpeedState) else None

    # ---- prepare --------------------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """accelerate's ``prepare``; with a plugin, the model, optimizer and schedule become one engine
        (``plait.accelerate.ds_prepare``), the dataloaders as accelerate's. Returns the objects in order."""
        plugin = self.deepspeed_plugin
        if plugin is None:
            return super().prepare(*args, device_placement=device_placement)
        if device_placement is not None:
            raise ValueError(
                "You can't customize device placements with DeepSpeed (plait.accelerate): drop "
                "device_placement"
            )
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        if len(models) > 1 or (models and self.engine is not None):
            raise ConfigError(
                "plait.accelerate: one model per Accelerator under DeepSpeed (as accelerate); create "
                "another Accelerator for another model"
            )
        loaders = [a for a in args if isinstance(a, DataLoader)]
        result = [
            super(Accelerator, self).prepare(a) if isinstance(a, DataLoader) else a for a in args
        ]
        micro = ds_prepare.micro_batch_size(plugin, loaders, self.split_batches, self.num_processes)
        self._set_accumulation(plugin)
        optimizer = next(
            (a for a in args if isinstance(a, (torch.optim.Optimizer, ds_prepare.DummyOptim))), None
        )
        scheduler = next((a for a in args if _is_schedule(a)), None)
        ds_prepare.check_objects(plugin.deepspeed_config, optimizer, scheduler)
        if not models:
            return _one_or_tuple(result)
        ds_prepare.fill_auto(
            plugin, models[0], optimizer, scheduler, micro, self.num_processes, self.split_batches
        )
        if self.fp8_request is not None:
            section = self.fp8_request.section(models[0])
            fp8.write(plugin.deepspeed_config, section, self.fp8_request.source)
        if torch.distributed.is_initialized():
            launch.leave_at_exit()  # accelerate started the group; it stays up until the process ends
        self.engine, opt, sched = ds_prepare.build(
            models[0],
            plugin.deepspeed_config,
            optimizer,
            scheduler,
            self.step_scheduler_with_optimizer,
            self.split_batches,
        )
        self._compile(self.engine)
        if isinstance(sched, accelerate.scheduler.AcceleratedScheduler) and not isinstance(
            sched, ds_prepare.DeepSpeedSchedulerWrapper
        ):
            self._schedulers.append(
                sched
            )  # saved by save_state (the engine saves its own schedule)
        swap = {
            id(a): b
            for a, b in ((models[0], self.engine), (optimizer, opt), (scheduler, sched))
            if a is not None
        }
        return _one_or_tuple([swap.get(id(a), r) for a, r in zip(args, result)])

    def _compile(self, engine) -> None:
        """accelerate's DeepSpeed path: with a dynamo backend (``dynamo_backend=``, ``--dynamo_backend``),
        ``engine.compile(backend, kwargs)`` (plait compiles each transformer block, as regional compilation)."""
        dynamo = self.state.dynamo_plugin
        if dynamo is None or dynamo.backend == DynamoBackend.NO:
            return
        kwargs = dynamo.to_kwargs()
        kwargs.pop("use_regional_compilation", None)
        engine.compile(str(kwargs.pop("backend")).lower(), kwargs)

    def _set_accumulation(self, plugin) -> None:
        """accelerate's rule: "auto" takes the Accelerator's steps; a number in the ds_config wins (warned)."""
        plugin.fill_match(
            "gradient_accumulation_steps",
            must_match=False,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )
        steps = plugin.get_value("gradient_accumulation_steps")
        if steps != self.gradient_accumulation_steps and self.is_main_process:
            log.warning(
                "gradient accumulation steps: the Accelerator has %s, the ds_config %s; using the ds_config's",
                self.gradient_accumulation_steps,
                steps,
            )
        self.gradient_accumulation_steps = steps

    # ---- the step -------------------------------------------------------------------------------------------
    def backward(self, loss, **kwargs):
        """``engine.backward(loss)`` then ``engine.step()``, at the boundary accelerate's ``sync_gradients`` sets
        (accelerate's DeepSpeed path); without an engine, accelerate's ``backward``.

        Raises:
            ConfigError: keyword arguments (DeepSpeed's ``retain_graph`` etc.) with the engine.
        """
        if self.engine is None:
            return super().backward(loss, **kwargs)
        if kwargs:
            raise ConfigError(
                f"plait.accelerate: backward({', '.join(kwargs)}=...) is not served by plait's engine; "
                "call accelerator.backward(loss)"
            )
        self.engine.set_gradient_accumulation_boundary(self.sync_gradients)
        self.engine.backward(loss)
        self.engine.step()

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The engine clipped in its step at the ds_config's ``gradient_clipping``; returns the gradient norm of
        the last step (a float, before clipping; None before the first), as accelerate's DeepSpeed path.

        Raises:
            ConfigError: ``max_norm`` is not the ds_config's ``gradient_clipping``, or ``norm_type`` is not 2.
        """
        if self.engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        clip = self.engine.gradient_clipping()
        if float(max_norm) != float(clip) or float(norm_type) != 2.0:
            raise ConfigError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}): plait's engine clips the "
                f'L2 norm at the ds_config\'s gradient_clipping = {clip}; set "gradient_clipping": '
                f"{max_norm} in the ds_config (or pass max_norm={clip})"
            )
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def clip_grad_value_(self, parameters, clip_value):
        if self.engine is None:
            return super().clip_grad_value_(parameters, clip_value)
        raise ConfigError(
            "clip_grad_value_ is not served under DeepSpeed (accelerate refuses it too); use "
            "clip_grad_norm_ with the ds_config's gradient_clipping"
        )

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the engine's last step was skipped (a non-finite gradient norm); accelerate's without one."""
        if self.engine is None:
            return super().optimizer_step_was_skipped
        return not self.engine.was_step_applied()

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save_state(
        self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs
    ):
        """accelerate's ``save_state``; the engine's checkpoint (weights, optimizer, its schedule) goes to
        ``<dir>/pytorch_model`` before accelerate writes the RNG states, as DeepSpeed's does.
        ``save_model_func_kwargs`` go to ``engine.save_checkpoint``."""
        if self.engine is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        engine = self.engine
        handle = self.register_save_state_pre_hook(
            lambda models, weights, folder: engine.save_checkpoint(
                folder, MODEL_NAME, **save_model_func_kwargs
            )
        )
        try:
            return super().save_state(output_dir, safe_serialization)
        finally:
            handle.remove()

    def load_state(self, input_dir=None, **load_model_func_kwargs):
        """accelerate's ``load_state``; the engine's checkpoint is read before accelerate restores the RNG
        states, as DeepSpeed's is. ``load_model_func_kwargs`` (but ``map_location``) go to
        ``engine.load_checkpoint`` (``map_location`` and ``load_kwargs`` to accelerate)."""
        if self.engine is None:
            return super().load_state(input_dir, **load_model_func_kwargs)
        own = ("map_location", "load_kwargs")  # accelerate's own arguments
        ours = {k: v for k, v in load_model_func_kwargs.items() if k not in own}
        theirs = {k: v for k, v in load_model_func_kwargs.items() if k in own}
        engine = self.engine
        handle = self.register_load_state_pre_hook(
            lambda models, folder: engine.load_checkpoint(folder, MODEL_NAME, **ours)
        )
        try:
            return super().load_state(input_dir, **theirs)
        finally:
            handle.remove()

    # ---- the model ----------------------------------------------------------------------------------------
    def unwrap_model(self, model, *args, **kwargs):
        """The engine's model for the engine; accelerate's ``unwrap_model`` otherwise."""
        if self.engine is not None and model is self.engine:
            model = self.engine.module
        return super().unwrap_model(model, *args, **kwargs)

    def get_state_dict(self, model, unwrap: bool = True):
        """The engine's whole state dict (the engine or its model): ZeRO-0/1/2 on every rank (copies);
        ZeRO-3 gathered, on rank 0 (None on the others), as accelerate's DeepSpeed path. Collective.

        Raises:
            ValueError: ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save`` false (accelerate's rule).
        """
        if self.engine is None or (model is not self.engine and model is not self.engine.module):
            return super().get_state_dict(model, unwrap)
        if self.engine.zero_optimization_stage() < 3:
            return {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}
        state = gathered_state_dict(self.engine, "get_state_dict")
        if state is False:
            raise ValueError(
                "get_state_dict under ZeRO-3 gathers the weights only with "
                '"stage3_gather_16bit_weights_on_model_save": true in the ds_config '
                "(zero3_save_16bit_model=True in the DeepSpeedPlugin); or save with save_state"
            )
        return state

    def save_model(self, model, save_directory, *args, **kwargs):
        """accelerate's ``save_model`` of the engine's model (its weights from ``get_state_dict``)."""
        if self.engine is not None and model is self.engine:
            model = self.engine.module
        return super().save_model(model, save_directory, *args, **kwargs)


def _plugin(given) -> DeepSpeedPlugin | None:
    """The plugin: the one given, else one from ``accelerate launch``'s environment (as accelerate reads it)."""
    if isinstance(given, dict):
        raise ConfigError(
            f"plait.accelerate serves one DeepSpeedPlugin; got {len(given)} (deepspeed_plugins="
            f"{sorted(given)}): pass deepspeed_plugin=DeepSpeedPlugin(...)"
        )
    if given is not None:
        if not isinstance(given, DeepSpeedPlugin):
            raise TypeError("`deepspeed_plugin` must be a DeepSpeedPlugin object.")
        return given
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return DeepSpeedPlugin()
    return None


@contextlib.contextmanager
def _without_env(*names: str):
    """``os.environ[name]`` absent inside for each of ``names`` (restored after)."""
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _is_schedule(obj) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, ds_prepare.DummyScheduler))


def _one_or_tuple(items: list):
    return items[0] if len(items) == 1 else tuple(items)
