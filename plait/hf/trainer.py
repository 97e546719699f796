"""``plait.hf.Trainer``: the Hugging Face ``Trainer`` with plait's engine in DeepSpeed's place.

A Trainer script moves from DeepSpeed to plait by its import line::

    from plait.hf import Trainer, TrainingArguments      # was: from transformers import ...
    args = TrainingArguments(output_dir="out", deepspeed="ds_config.json", ...)
    Trainer(model=model, args=args, train_dataset=ds, data_collator=collate).train()

transformers keeps the arguments, callbacks, logging, evaluation and ``TrainerState``; plait owns the
training loop (one engine step per ``gradient_accumulation_steps`` micro-batches, the loss as transformers
computes it), checkpoints (``plait.hf.checkpoints``) and ``save_model``. The optimizer and schedule come
from the ds_config (``plait.hf.config_fill``) or from ``args.optim`` (``plait.hf.optim_names``). ZeRO data
parallelism only (stages 0-3, offload): tp and pp need ``plait.layers``. Details: ``docs/hf.md``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
import transformers
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import TrainOutput

import plait
from plait.checkpoint.export16 import gathered_state_dict
from plait.config import ConfigError
from plait.hf import read_ahead, train_data
from plait.hf.checkpoints import PREFIX, STATE_NAME, on_rank0, resume_folder, rotate, write_folder
from plait.hf.config_fill import check_batch, fill_from_args, hf_hidden_size, say_filled
from plait.hf.loop_parts import LossWindow, new_state, plan_steps
from plait.hf.optim_names import hf_optimizer, hf_scheduler
from plait.zero.weights import has_meta_parameters
from plait.parallel import launch

log = logging.getLogger("plait")


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` on plait's engine (see the module docstring). Takes the same arguments;
    ``args`` must be ``plait.hf.TrainingArguments`` (with the ds_config in ``deepspeed=`` or ``plait=``).

    Attributes:
        engine: the ``plait.engine.Engine`` once ``train()`` has built it (None before).
    """

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        if not hasattr(self.args, "ds_config"):
            raise ConfigError(
                "plait.hf.Trainer needs plait.hf.TrainingArguments (from plait.hf import "
                "TrainingArguments) with deepspeed= or plait= set to the ds_config"
            )
        self.engine = None
        self._read_ahead = None  # the train loader's ReadAheadCollate, while train() runs
        if self._places_model():
            self._move_model_to_device(self.model, self.args.device)

    def create_accelerator_and_postprocess(self):
        """transformers' accelerator, without accelerate's autocast: the ds_config sets the precision (the
        engine casts the model), as accelerate leaves it to DeepSpeed. ``ACCELERATE_MIXED_PRECISION`` in the
        environment (set by ``accelerate launch``, and by transformers 4.x's ``TrainingArguments(bf16=True)``)
        would otherwise wrap the model's forward in autocast at the first ``evaluate()`` and change every later
        step."""
        super().create_accelerator_and_postprocess()
        self.accelerator.native_amp = False

    def _places_model(self) -> bool:
        """transformers' rule for moving the model at construction (not a model-parallel or quantized model,
        nor under fp16/bf16 full evaluation without training); a meta model is placed by the engine."""
        args, model = self.args, self.model
        return not (
            has_meta_parameters(model)
            or getattr(self, "is_model_parallel", False)
            or getattr(model, "is_quantized", False)
            or ((args.fp16_full_eval or args.bf16_full_eval) and not args.do_train)
        )

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """transformers' ``train``. ``resume_from_checkpoint=True``: the newest complete ``checkpoint-N`` in
        ``output_dir``, passing over (with a one-line warning each) newer folders a crashed save left.

        Raises:
            CheckpointError: the path given names an incomplete or damaged checkpoint (the message names it
                and the last complete one beside it).
            ValueError: ``True`` and no complete checkpoint in ``output_dir``.
        """
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = on_rank0(
                lambda: resume_folder(self.args.output_dir, resume_from_checkpoint, warn=True)
            )
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )

    def evaluate(self, *a, **kw):
        """transformers' ``evaluate``; a model from ``plait.hf.from_pretrained`` called before ``train()``
        first gets its engine (which reads its weights), as DeepSpeed builds one for evaluation."""
        if self.engine is None and has_meta_parameters(self.model):
            self._build_engine(
                self._plan(self.args)[0]
                if self.train_dataset is not None
                else max(self.args.max_steps, 1)
            )
        return super().evaluate(*a, **kw)

    # ---- the engine ---------------------------------------------------------------------------------------
    def _dp(self) -> int:
        """Data-parallel ranks: the processes over the config's tensor x pipeline size."""
        raw = self.args.ds_config()
        world = dist.get_world_size() if dist.is_initialized() else 1
        return world // (
            raw.get("tensor_parallel", {}).get("size", 1) * raw.get("pipeline", {}).get("size", 1)
        )

    def _build_engine(self, max_steps: int):
        """Raises ConfigError: the engine's micro-batch or accumulation differs from the arguments'."""
        args = self.args
        raw = self.args.ds_config()
        config = fill_from_args(
            raw, args, dp=self._dp(), max_steps=max_steps, hidden_size=hf_hidden_size(self.model)
        )
        say_filled(raw, config, args)
        # TrainingArguments.optim: plait.hf.optim_names
        config, optimizer, groups = hf_optimizer(self, config)
        scheduler = hf_scheduler(args, max_steps) if not config.get("scheduler") else None
        if dist.is_initialized():
            launch.leave_at_exit()  # transformers started the group and leaves it alive at exit
        # plait.hf.from_pretrained
        weights = self.model.config.name_or_path if has_meta_parameters(self.model) else None
        if args.gradient_checkpointing:  # as transformers' own loop does before it wraps the model
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs
            )
        self.engine = plait.initialize(
            self.model,
            config,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            weights=weights,
            units=self._stage3_units(self.model),
            model_parameters=groups,
        )
        # as accelerate's DeepSpeed path: engine.compile(backend, compile_kwargs)
        if args.torch_compile:
            self.engine.compile(
                args.torch_compile_backend or "inductor",
                {"mode": args.torch_compile_mode} if args.torch_compile_mode else {},
            )
        check_batch(self.engine, args)
        self.model_wrapped = self.engine
        self.optimizer, self.lr_scheduler = self.engine.optimizer, self.engine.lr_scheduler
        return self.engine

    def _stage3_units(self, model):
        """ZeRO-3's gather units for ``model`` (``plait.initialize(units=...)``); None: plait's choice. A subclass
        whose model reads parameters outside their module's forward (TRL's fused LM head) names others."""
        return None

    # ---- the loop -------------------------------------------------------------------------------------------
    def _inner_training_loop(
        self,
        batch_size=None,
        args=None,
        resume_from_checkpoint=None,
        trial=None,
        ignore_keys_for_eval=None,
    ):
        args = args or self.args
        max_steps, epochs, updates_per_epoch = self._plan(args)
        engine = self.engine or self._build_engine(max_steps)
        first_epoch, skip, resumed = self._start_state(
            args, engine, max_steps, epochs, updates_per_epoch, resume_from_checkpoint
        )
        loader, sampler, self._read_ahead = train_data.train_loader(self, engine)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        window = LossWindow(
            torch.zeros((), dtype=torch.float32, device=engine.device), self.state.global_step
        )
        for epoch in range(first_epoch, epochs):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            start = skip if epoch == first_epoch else 0
            batches = iter(train_data.skipping(self, loader, engine, start) if start else loader)
            if resumed is not None and epoch == first_epoch:
                # after the iterator drew its seed and with no skipped micro-batch collated: the generators
                # then stand where the uninterrupted run's stood at this micro-batch (transformers' order)
                self._load_rng_state(resumed)
                before = read_ahead.load(resumed, self.args.process_index)
                if self._read_ahead is not None and before is not None and start > 0:
                    # mid-epoch, the uninterrupted run had collated the next micro-batch before the save
                    self._read_ahead.resume(before, read_ahead.capture())
            for i, inputs, num_items in self._windows(batches, start, len(loader)):
                if not self._micro_step(engine, inputs, i, len(loader), epoch, window, num_items):
                    continue
                self._log_evaluate_save(engine, window, trial, ignore_keys_for_eval)
                if self.control.should_training_stop or self.state.global_step >= max_steps:
                    break
            engine.set_gradient_accumulation_boundary(None)
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._log_evaluate_save(engine, window, trial, ignore_keys_for_eval)
            if self.control.should_training_stop or self.state.global_step >= max_steps:
                break
        window.drain(engine, self.state.global_step)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        mean = window.total / max(self.state.global_step - window.started_at, 1)
        return TrainOutput(self.state.global_step, mean, {"train_loss": mean})

    def _windows(self, batches, start: int, count: int):
        """(index, micro-batch, num_items_in_batch) for the micro-batches ``start``.. of ``count``: each
        accumulation step's micro-batches are read together and their label tokens counted (over the ranks when
        ``average_tokens_across_devices``) by transformers' ``get_batch_samples``, before the step's first
        forward, as transformers' loop does."""
        gas, i = self.args.gradient_accumulation_steps, start
        while i < count:
            want = min(gas - i % gas, count - i)
            samples, num_items = self.get_batch_samples(batches, want, self.args.device)
            for inputs in samples:
                yield i, inputs, num_items
                i += 1
            if len(samples) < want:
                return

    def _plan(self, args) -> tuple[int, int, int]:
        """(max_steps, epochs, optimizer steps per epoch) as transformers counts them (``plan_steps``)."""
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs a train_dataset")
        return plan_steps(args, len(self.train_dataset), self._dp())

    def _start_state(
        self, args, engine, max_steps, epochs, updates_per_epoch, resume
    ) -> tuple[int, int, str | None]:
        """A fresh ``TrainerState``, or the checkpoint's (with this run's limits); (first epoch, micro-batches
        of it already trained, the checkpoint folder whose RNG states the loop restores, or None)."""
        self.state = new_state(args, max_steps, epochs)
        if resume is None or resume is False:
            return 0, 0, None
        # a folder (``train`` resolved True to the newest complete checkpoint)
        first_epoch, skip = self._resume(
            engine, resume, updates_per_epoch, args.gradient_accumulation_steps
        )
        fresh = new_state(
            args, max_steps, epochs
        )  # this run's limits and intervals, not the saved run's
        for key in (
            "max_steps",
            "num_train_epochs",
            "logging_steps",
            "eval_steps",
            "save_steps",
            "train_batch_size",
            "is_local_process_zero",
            "is_world_process_zero",
        ):
            setattr(self.state, key, getattr(fresh, key))
        return first_epoch, skip, resume

    def _micro_step(
        self, engine, inputs, i: int, count: int, epoch: int, window: LossWindow, num_items=None
    ) -> bool:
        """Micro-batch ``i`` of ``count`` through ``training_step`` (``num_items``: the step's label tokens);
        True when it ended an optimizer step (the state and callbacks then moved on)."""
        args, gas = self.args, self.args.gradient_accumulation_steps
        last_of_step = (
            i + 1
        ) % gas == 0 or i + 1 == count  # an epoch's short last accumulation steps too
        if i % gas == 0:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            engine.train()  # evaluate() leaves the model in eval mode
        engine.set_gradient_accumulation_boundary(True if last_of_step else None)
        loss = self.training_step(engine, inputs, num_items_in_batch=num_items)
        window.sum += loss.float()
        if last_of_step:
            self.state.global_step += 1
            self.state.epoch = epoch + (i + 1) / count
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        return last_of_step

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One micro-batch on the engine ``model``: ``compute_loss`` of ``_prepare_inputs(inputs)``, ``backward``
        and ``step`` (applied at the accumulation boundary), as transformers' DeepSpeed path. With
        ``num_items_in_batch`` (the step's label tokens) a model taking loss kwargs normalizes its loss over the
        whole step, as under transformers: the engine then does not divide it by the accumulation steps
        (``scale_wrt_gas=False``, as transformers tells DeepSpeed). Returns the micro-batch's share of the
        step's logged loss, detached (shape ``[]``). Subclasses wrap it as they wrap transformers' (TRL's do)."""
        loss = self.compute_loss(
            model, self._prepare_inputs(inputs), num_items_in_batch=num_items_in_batch
        )
        scaled = getattr(
            self, "loss_is_scaled_for_ga", None
        )  # transformers >= 5 lets a subclass say it
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        model.backward(loss, scale_wrt_gas=not scaled)
        model.step()
        return loss.detach() if scaled else loss.detach() / self.args.gradient_accumulation_steps

    def _log_evaluate_save(self, engine, window: LossWindow, trial, ignore_keys_for_eval) -> None:
        """What the callbacks asked for at a step's or an epoch's end: log, evaluate, save."""
        if self.control.should_log and self.state.global_step > window.logged_at:
            self.log(
                {
                    "loss": window.drain(engine, self.state.global_step),
                    "grad_norm": engine.grad_norm,
                    "learning_rate": engine.get_lr()[0],
                }
            )
            self.control.should_log = False
        if self.control.should_evaluate:
            self.evaluate(ignore_keys=ignore_keys_for_eval)
            self.control.should_evaluate = False
        if self.control.should_save:
            self._save_checkpoint(self.model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
            self.control.should_save = False

    # ---- checkpoints ------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        """``output_dir/checkpoint-N``, whole or not at all (``write_folder``), then ``save_total_limit``.
        Raises ``CheckpointError`` on every rank when any rank could not write (nothing is published)."""

        def write(tmp: str) -> None:
            self.engine.save_checkpoint(tmp)
            self._write_model(tmp)
            self._save_rng_state(tmp)
            read_ahead.save(tmp, self._read_ahead, self.args.process_index)
            if self._is_rank0():
                self.state.save_to_json(os.path.join(tmp, STATE_NAME))

        folder = write_folder(self.args.output_dir, f"{PREFIX}-{self.state.global_step}", write)
        if self._is_rank0():
            rotate(
                self.args.output_dir,
                self.args.save_total_limit,
                keep=(folder, self.state.best_model_checkpoint),
            )

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """No-op: the engine loads the checkpoint inside ``train()`` (transformers calls this before)."""

    def _resume(self, engine, path: str, updates_per_epoch: int, gas: int) -> tuple[int, int]:
        """Load ``path`` (a complete checkpoint: ``train`` checked it); (first epoch, micro-batches to skip).
        The RNG states are restored later, by the loop (``_inner_training_loop``)."""
        engine.load_checkpoint(path)
        self.state = TrainerState.load_from_json(os.path.join(path, STATE_NAME))
        step = self.state.global_step
        return step // updates_per_epoch, (step % updates_per_epoch) * gas

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The whole model in its training dtype, by rank 0, with ``save_pretrained`` (see the module
        docstring). Collective once ``train()`` has built the engine."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        self._write_model(output_dir or self.args.output_dir)
        if dist.is_initialized():
            dist.barrier()

    def _write_model(self, output_dir: str) -> None:
        """``save_model`` without its closing barrier (a checkpoint's save agrees once, at its end)."""
        state = gathered_state_dict(self.engine, output_dir)
        if state is False or state is None:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.engine.module.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _is_rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0
