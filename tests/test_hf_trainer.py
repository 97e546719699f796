"""``plait.hf.Trainer``: an unmodified Hugging Face Trainer script (``tests/data/hf_trainer_script.py``, only
its import line changed) under ``torchrun --nproc-per-node 2`` on CPU, with unmodified transformers models
(a small ``LlamaForCausalLM`` and ``BertForMaskedLM``) and real configs: the seed's all-"auto" ZeRO-2 +
offload_optimizer config and the Hugging Face test suite's ZeRO-3 config (offload of optimizer and
parameters).

Tolerances: a resumed run continues the uninterrupted one exactly (the checkpoint holds the fp32 master
weights, Adam's moments, the schedule and the data position; the issue asks 1e-6 in float32 and the
runs agree to the last bit, so the test asserts 1e-6 and a run resumed one checkpoint early fails it).
``save_model`` writes the training dtype's weights, so ``from_pretrained`` gives the same logits bit for bit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from plait.config import ConfigError
from plait.hf import Trainer, TrainingArguments

DATA = Path(__file__).parent / "data"
SCRIPT = DATA / "hf_trainer_script.py"
ZERO2_OFFLOAD = Path(__file__).parent.parent / "examples" / "configs" / "zero2_offload_hf.json"
HF_ZERO3 = DATA / "ds_configs" / "transformers__ds_config_zero3_bf16.json"


def launch(out, config, model, steps, *extra, procs=2, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(procs),
        str(SCRIPT),
        str(out),
        str(config),
        model,
        str(steps),
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in losses}, json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("model", ["llama", "bert"])
@pytest.mark.parametrize("config", [ZERO2_OFFLOAD, HF_ZERO3], ids=["zero2-offload", "hf-zero3"])
def test_trainer_script_trains_resumes_and_saves(model, config, tmp_path):
    full, result = launch(tmp_path / "full", config, model, 6)
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and result["global_step"] == 6
    assert result["max_logit_diff"] == 0.0  # save_model -> from_pretrained
    assert len(result["eval_losses"]) == 2  # evaluate() at steps 3 and 6
    resumed, _ = launch(
        tmp_path / "resumed", config, model, 6, "--resume", str(tmp_path / "full" / "checkpoint-3")
    )
    assert sorted(resumed) == [4, 5, 6]
    assert max(abs(resumed[s] - full[s]) for s in (4, 5, 6)) <= 1e-6
    assert any(
        abs(full[s] - full[s + 1]) > 1e-6 for s in (3, 4, 5)
    )  # a one-step shift would be visible


def test_the_config_sets_the_precision_whatever_accelerate_launch_says(tmp_path):
    """``accelerate launch --mixed_precision bf16`` exports ACCELERATE_MIXED_PRECISION=bf16; with a float32
    ds_config the engine trains and evaluates in float32 (accelerate's autocast stays off, as under DeepSpeed),
    so the saved model still gives the trained model's logits bit for bit. With the autocast the first
    ``evaluate()`` switched on, they differed by 1.8e-3."""
    _, result = launch(
        tmp_path, ZERO2_OFFLOAD, "llama", 3, procs=1, env={"ACCELERATE_MIXED_PRECISION": "bf16"}
    )
    assert result["max_logit_diff"] == 0.0 and len(result["eval_losses"]) == 1


def test_a_checkpoint_resumes_at_another_process_count(tmp_path):
    """Saved by 2 processes, resumed by 1 (dp 2 -> 1): the engine checkpoint reshards on load."""
    launch(tmp_path / "two", HF_ZERO3, "llama", 3)
    resumed, result = launch(
        tmp_path / "one",
        HF_ZERO3,
        "llama",
        5,
        "--resume",
        str(tmp_path / "two" / "checkpoint-3"),
        procs=1,
    )
    assert sorted(resumed) == [4, 5] and result["global_step"] == 5


def tiny_llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )


def test_a_config_value_that_disagrees_with_the_arguments_is_refused_naming_both(tmp_path):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "zero_optimization": {"stage": 2},
    }
    args = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed=config,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_steps=1,
        report_to=[],
        use_cpu=True,
    )
    trainer = Trainer(
        model=tiny_llama(), args=args, train_dataset=[{"input_ids": [1, 2], "labels": [1, 2]}] * 4
    )
    with pytest.raises(ConfigError) as err:
        trainer.train()
    assert (
        "train_micro_batch_size_per_gpu = 4 vs TrainingArguments per_device_train_batch_size = 2"
        in str(err.value)
    )
    assert "optimizer.params.lr = 0.0003 vs TrainingArguments learning_rate = 0.001" in str(
        err.value
    )


def test_arguments_take_the_config_once_and_the_trainer_needs_them(tmp_path):
    with pytest.raises(ConfigError, match="both deepspeed= and plait="):
        TrainingArguments(
            output_dir=str(tmp_path), deepspeed={}, plait={}, report_to=[], use_cpu=True
        )
    args = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed={"zero_optimization": {"stage": 1}},
        use_cpu=True,
        report_to=[],
    )
    assert args.deepspeed is None and args.plait == {"zero_optimization": {"stage": 1}}
    with pytest.raises(ConfigError, match="needs plait.hf.TrainingArguments"):
        Trainer(
            model=tiny_llama(),
            args=transformers.TrainingArguments(
                output_dir=str(tmp_path), report_to=[], use_cpu=True
            ),
        )


def test_a_config_that_leaves_the_accumulation_out_takes_the_arguments(tmp_path):
    """{"train_batch_size": "auto"} and no accumulation key: the Trainer's 4 micro-batches per step hold (an
    engine stepping after every micro-batch would take 4x the optimizer and schedule steps)."""
    config = {
        "train_batch_size": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 2},
    }
    args = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed=config,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        learning_rate=1e-3,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    data = [{"input_ids": [i % 64, 2, 3, 4], "labels": [i % 64, 2, 3, 4]} for i in range(32)]
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=data)
    trainer.train()
    assert trainer.engine.gradient_accumulation_steps() == 4 and trainer.engine.global_steps == 2


def test_an_epoch_logged_at_its_end_and_a_resumed_epoch_keeps_its_order(tmp_path):
    """logging_strategy='epoch' logs each epoch's mean loss at its end; the data order of epoch k depends
    only on (seed, k), so a resume into epoch 2 sees what the uninterrupted run saw there."""
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 1},
    }
    data = [
        {"input_ids": [i % 64, (3 * i) % 64, 5], "labels": [i % 64, (3 * i) % 64, 5]}
        for i in range(8)
    ]

    def run(out, epochs, resume=None):
        args = TrainingArguments(
            output_dir=str(out),
            deepspeed=config,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            num_train_epochs=epochs,
            report_to=[],
            use_cpu=True,
            logging_strategy="epoch",
            save_strategy="epoch",
            seed=3,
        )
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    full = run(tmp_path / "a", 3)
    assert len(full) == 3
    resumed = run(tmp_path / "b", 3, resume=str(tmp_path / "a" / "checkpoint-8"))
    assert resumed[-1] == pytest.approx(full[-1], abs=1e-6)


@pytest.mark.parametrize(
    "optimizer_section", [True, False], ids=["config-optimizer", "trainer-optimizer"]
)
def test_a_model_from_plait_from_pretrained_trains_as_the_loaded_one(optimizer_section, tmp_path):
    """``plait.hf.from_pretrained`` builds the model on the meta device and the engine reads its weights from
    the checkpoint (ZeRO-3): the losses equal those of ``LlamaForCausalLM.from_pretrained`` to float32's last
    bit (the same values reach the same flat buffers). Without an optimizer section the Trainer's own AdamW
    is built on the meta parameters, which must stay the parameters the engine trains."""
    from plait.hf import from_pretrained

    tiny_llama().save_pretrained(tmp_path / "ckpt")
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if optimizer_section:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    data = [
        {"input_ids": [i % 64, (5 * i) % 64, 7, 9], "labels": [i % 64, (5 * i) % 64, 7, 9]}
        for i in range(16)
    ]

    def run(model, out):
        args = TrainingArguments(
            output_dir=str(tmp_path / out),
            deepspeed=config,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            weight_decay=0.1,
            max_steps=4,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_steps=1,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    empty = from_pretrained(transformers.LlamaForCausalLM, tmp_path / "ckpt")
    assert {p.device.type for p in empty.parameters()} == {"meta"}
    loaded = run(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt"), "loaded")
    assert run(empty, "empty") == pytest.approx(loaded, abs=1e-6, rel=0)
    assert loaded[0] != pytest.approx(loaded[-1], abs=1e-3)  # the steps train


def test_evaluate_before_train_reads_the_weights_of_a_meta_model(tmp_path):
    """``evaluate()`` first on a ``from_pretrained`` (meta) model builds the engine, which reads the weights:
    the eval loss equals the loaded model's to float32's last bit."""
    from plait.hf import from_pretrained

    tiny_llama().save_pretrained(tmp_path / "ckpt")
    data = [
        {"input_ids": [i % 64, (5 * i) % 64, 7, 9], "labels": [i % 64, (5 * i) % 64, 7, 9]}
        for i in range(8)
    ]
    losses = []
    for model in (
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt"),
        from_pretrained(transformers.LlamaForCausalLM, tmp_path / "ckpt"),
    ):
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            deepspeed={
                "zero_optimization": {"stage": 3},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            },
            per_device_eval_batch_size=2,
            report_to=[],
            use_cpu=True,
        )
        losses.append(Trainer(model=model, args=args, eval_dataset=data).evaluate()["eval_loss"])
    assert losses[1] == pytest.approx(losses[0], abs=1e-6, rel=0) and losses[0] > 1.0


def test_from_pretrained_needs_safetensors(tmp_path):
    from plait.hf import from_pretrained

    model = tiny_llama()
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no .safetensors weights"):
        from_pretrained(transformers.LlamaForCausalLM, tmp_path / "bin")


def _train_tiny(tmp_path, **compile_args):
    torch.manual_seed(0)
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 3},
    }
    args = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed=config,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_steps=3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        **compile_args,
    )
    data = [{"input_ids": [i % 64, 2, 3, 4], "labels": [i % 64, 2, 3, 4]} for i in range(16)]
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=data)
    trainer.train()
    return trainer.engine, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_torch_compile_arguments_compile_the_decoder_layers(tmp_path):
    """``torch_compile=True`` compiles as accelerate's DeepSpeed path does (``engine.compile(backend, kwargs)``),
    here under ZeRO-3; the losses equal the eager run's (aot_eager runs the same kernels: 1e-6)."""
    eager, losses = _train_tiny(tmp_path / "eager")
    compiled, compiled_losses = _train_tiny(
        tmp_path / "compiled", torch_compile=True, torch_compile_backend="aot_eager"
    )
    assert compiled.is_compiled and not eager.is_compiled and len(losses) == 3
    assert max(abs(a - b) for a, b in zip(losses, compiled_losses)) <= 1e-6
