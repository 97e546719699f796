"""TRL's trainers on plait: change a TRL script's import line and its ``deepspeed=`` config trains on plait::

    from plait.trl import SFTConfig, SFTTrainer      # was: from trl import SFTConfig, SFTTrainer
    args = SFTConfig(output_dir="out", deepspeed="ds_config.json", ...)
    SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer).train()

Each trainer is TRL's own class with plait's Trainer below it (``plait.hf.with_plait_engine(trl.X,
TRLTrainer)``), each config TRL's with plait's ``deepspeed=`` (``plait.hf.with_plait_arguments``): TRL's
losses, collators, data preparation, metrics and logging run unchanged; the loop, engine, checkpoints and
``save_model`` are ``plait.hf.Trainer``'s (see it for the loss semantics: each micro-batch's own mean, as
DeepSpeed's engine). DPO's reference model gets a forward-only engine (``plait.trl.trainer``). What is not
served is refused by name: GRPO (its sampler and generation), vLLM, Liger, PEFT, activation offloading, the
reference-model sync and precomputed reference log-probabilities. Needs TRL (``pip install trl``).
"""

try:
    import trl
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError("plait.trl needs TRL: pip install trl (or pip install 'plait[trl]')") from err

from plait.hf.subclass import with_plait_arguments, with_plait_engine
from plait.trl.trainer import TRLTrainer

SFTTrainer = with_plait_engine(trl.SFTTrainer, TRLTrainer, __name__)
DPOTrainer = with_plait_engine(trl.DPOTrainer, TRLTrainer, __name__)
RewardTrainer = with_plait_engine(trl.RewardTrainer, TRLTrainer, __name__)
GRPOTrainer = with_plait_engine(trl.GRPOTrainer, TRLTrainer, __name__)
SFTConfig = with_plait_arguments(trl.SFTConfig, __name__)
DPOConfig = with_plait_arguments(trl.DPOConfig, __name__)
RewardConfig = with_plait_arguments(trl.RewardConfig, __name__)
GRPOConfig = with_plait_arguments(trl.GRPOConfig, __name__)

__all__ = [
    "SFTTrainer",
    "SFTConfig",
    "DPOTrainer",
    "DPOConfig",
    "RewardTrainer",
    "RewardConfig",
    "GRPOTrainer",
    "GRPOConfig",
    "TRLTrainer",
]
