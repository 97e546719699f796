"""``plait.hf.with_plait_engine``: a user's own ``transformers.Trainer`` subclass on plait's engine, its overrides
still called (``training_step`` and ``compute_loss`` once per micro-batch, ``log`` at each logged step), plait's
loop and engine below them."""

import pytest
import transformers

import plait.hf
from plait.engine import Engine


class Counting(transformers.Trainer):
    """A subclass as users write them: wraps three of the Trainer's methods and calls super()."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = {"training_step": 0, "compute_loss": 0, "log": 0}

    def training_step(self, *a, **kw):
        self.calls["training_step"] += 1
        return super().training_step(*a, **kw)

    def compute_loss(self, model, inputs, *a, **kw):
        self.calls["compute_loss"] += 1
        assert isinstance(model, Engine)  # plait's loop hands the engine down
        return super().compute_loss(model, inputs, *a, **kw)

    def log(self, logs, *a, **kw):
        self.calls["log"] += "loss" in logs
        return super().log(logs, *a, **kw)


class CountingArgs(transformers.TrainingArguments):
    pass


def test_a_users_trainer_subclass_runs_its_overrides_on_plaits_engine(tmp_path):
    trainer_class = plait.hf.with_plait_engine(Counting)
    args_class = plait.hf.with_plait_arguments(CountingArgs)
    assert trainer_class.__mro__[1:4] == (Counting, plait.hf.Trainer, transformers.Trainer)
    assert plait.hf.with_plait_engine(trainer_class) is trainer_class
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    args = args_class(
        output_dir=str(tmp_path),
        deepspeed={"zero_optimization": {"stage": 2}},
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
    )
    assert (
        isinstance(args, CountingArgs)
        and args.plait == {"zero_optimization": {"stage": 2}}
        and args.deepspeed is None
    )
    data = [{"input_ids": [i % 64, 2, 3, 4], "labels": [i % 64, 2, 3, 4]} for i in range(16)]
    trainer = trainer_class(model=model, args=args, train_dataset=data)
    trainer.train()
    assert trainer.engine.global_steps == 3
    assert trainer.calls == {"training_step": 6, "compute_loss": 6, "log": 3}


def test_with_plait_engine_names_what_it_needs():
    with pytest.raises(TypeError, match="needs a transformers.Trainer subclass"):
        plait.hf.with_plait_engine(object)
    with pytest.raises(TypeError, match="needs a transformers.TrainingArguments subclass"):
        plait.hf.with_plait_arguments(dict)
