"""``TRLTrainer``: what TRL's trainers need from ``plait.hf.Trainer`` beyond the Trainer itself.

``plait.trl``'s classes are ``with_plait_engine(trl.XTrainer, TRLTrainer)``: TRL's class first, then this,
then plait's Trainer, then transformers'. This class

* gives a reference model (DPO's ``ref_model``) an engine of its own, as TRL's ``prepare_deepspeed`` does
  under DeepSpeed: the run's ds_config without its ``optimizer``, ``scheduler`` and ``offload_optimizer``, a
  forward-only engine (``plait.optim.factory.NoOptimizer``); ZeRO-3 shards it over the dp ranks like the policy
  (no rank holds a whole copy), stages 0-2 become stage 0 (a whole copy per rank, as DeepSpeed's integration);
* puts the output head in the root module's ZeRO-3 unit when TRL's fused LM head replaced the model's forward
  (it reads ``lm_head.weight`` in the root's forward without calling the head, where DeepSpeed's path gathers it
  with ``GatheredParameters``): the head is whole from the model's forward through its backward;
* refuses, by name and with the reason, the TRL features plait's Trainer does not serve (``_UNSERVED``).
"""

from __future__ import annotations

from torch import nn

import plait
from plait.config import ConfigError
from plait.engine.model import stage3_units
from plait.hf.config_fill import fill_from_args, hf_hidden_size
from plait.hf.trainer import Trainer

# argument -> why plait does not serve it (checked on the TRL config, when the config has the field)
_UNSERVED = {
    "use_vllm": "generation through vLLM needs the whole weights in a vLLM engine, which plait does not feed",
    "use_liger_kernel": "Liger's kernels patch the model's forward, which plait's ZeRO hooks are not tested with",
    "activation_offloading": "TRL's activation offloading hooks are not tested with plait's ZeRO-3 gathers",
    "sync_ref_model": "TRL's reference-model sync reads DeepSpeed's or accelerate's parameters, not plait's shards",
    "precompute_ref_log_probs": "TRL precomputes through accelerate's DeepSpeed engine before the Trainer's engine exists",
}
_GRPO_REASON = (
    "TRL's GRPOTrainer draws its batches from its own sampler (each prompt repeated num_generations "
    "times per generation batch) and generates through accelerate's unwrap_model, while plait's Trainer "
    "loop draws from its DistributedSampler and its engine is not a model accelerate can unwrap (under "
    "ZeRO-3 the parameters are shards): neither is served yet. Train GRPO with trl.GRPOTrainer"
)


class TRLTrainer(Trainer):
    """``plait.hf.Trainer`` with TRL's needs (module docstring). Not used alone: ``plait.trl`` makes its classes
    with ``plait.hf.with_plait_engine(trl.XTrainer, TRLTrainer)``.

    Raises (at construction):
        ConfigError: a TRL feature plait does not serve is on (named, with the reason and the fix), a PEFT
            model, or GRPO.
    """

    def __init__(self, *a, **kw):
        _refuse_unserved(type(self), kw.get("args"), kw.get("model"))
        super().__init__(*a, **kw)

    def _stage3_units(self, model):
        """Plait's units, less the output head when TRL's fused LM head replaced ``model.forward`` (the head's
        parameters then belong to the root's unit)."""
        if "forward" not in vars(model) or not hasattr(model, "get_output_embeddings"):
            return None
        head = model.get_output_embeddings()
        units = stage3_units(model) or [
            m
            for m in model.modules()
            if m is not model and any(True for _ in m.parameters(recurse=False))
        ]
        return [m for m in units if m is not head]

    def _build_engine(self, max_steps: int):
        engine = super()._build_engine(max_steps)
        ref = getattr(self, "ref_model", None)
        if isinstance(ref, nn.Module):
            self.ref_model = self._reference_engine(ref, max_steps)
        return engine

    def _reference_engine(self, model: nn.Module, max_steps: int):
        """A forward-only engine for the frozen ``model`` (module docstring), in eval mode."""
        config = fill_from_args(
            self.args.ds_config(),
            self.args,
            dp=self._dp(),
            max_steps=max_steps,
            hidden_size=hf_hidden_size(model),
        )
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        zero = dict(config.get("zero_optimization", {}))
        zero.pop("offload_optimizer", None)
        if zero.get("stage", 0) != 3:
            zero["stage"] = 0
        config["zero_optimization"] = zero
        engine = plait.initialize(model, config, units=self._stage3_units(model))
        engine.eval()
        return engine


def _refuse_unserved(cls, args, model) -> None:
    import trl

    if issubclass(cls, trl.GRPOTrainer):
        raise ConfigError(f"plait.trl.GRPOTrainer: {_GRPO_REASON}")
    for name, why in _UNSERVED.items():
        if getattr(args, name, False):
            raise ConfigError(
                f"{cls.__name__} with {name}=True: {why}; set {name}=False in the "
                f"{type(args).__name__} to train on plait"
            )
    if model is not None and hasattr(model, "peft_config"):
        raise ConfigError(
            f"{cls.__name__} with a PEFT model (peft_config=...): plait's ZeRO trains every "
            "parameter of the model and is not tested with frozen base weights; train without "
            "peft_config, or with trl's own trainer"
        )
