"""``TrainingArguments(optim=...)`` through ``plait.hf.Trainer`` (``plait.hf.optim_names``): an unmodified tiny
Hugging Face Llama, a ds_config without an optimizer section (the Trainer's optimizer, as under DeepSpeed).

The 8-bit AdamW names give the engine plait's 8-bit block-wise moments: the moments' bytes per parameter are
2 (one uint8 code per moment) plus 2 x 4 bytes of float32 scale per block of at most 256 elements; the fp32 moments
of the default optimizer take 8.
"""

import logging

import pytest
import torch
import transformers

from plait.config import ConfigError
from plait.hf import Trainer, TrainingArguments
from plait.hf.optim_names import REFUSED

ZERO2 = {"zero_optimization": {"stage": 2}}
DATA = [{"input_ids": [i % 64, 2, 3, 4], "labels": [i % 64, 2, 3, 4]} for i in range(8)]


def tiny_llama():
    torch.manual_seed(0)
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


def train(tmp_path, config=ZERO2, optimizers=(None, None), **extra):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed=config,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
        weight_decay=0.1,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        **extra,
    )
    model = tiny_llama()
    optimizers = optimizers(model) if callable(optimizers) else optimizers
    trainer = Trainer(model=model, args=args, train_dataset=DATA, optimizers=optimizers)
    trainer.train()
    return trainer.engine


def moment_bytes_per_parameter(engine) -> float:
    """Bytes of the engine optimizer's moment storage (codes, scales or fp32 values) over its elements."""
    opt = engine.optimizer.optimizer
    stored = numel = 0
    for group in opt.param_groups:
        for p in group["params"]:
            numel += p.numel()
            if hasattr(opt, "kernels"):
                k = opt.kernels[p]
                names = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")
                stored += sum(getattr(k, n).nbytes for n in names if hasattr(k, n))
            else:
                stored += sum(opt.state[p][n].nbytes for n in ("exp_avg", "exp_avg_sq"))
    return stored / numel


@pytest.mark.parametrize(
    "name", ["adamw_torch_8bit", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"]
)
def test_an_8bit_adamw_name_gives_the_engine_8bit_moments(name, tmp_path):
    engine = train(tmp_path, optim=name)
    opt = engine.optimizer.optimizer
    assert opt.state_dtype == "int8" and opt.kind == "adamw"
    numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
    blocks = sum(len(opt.kernels[p].starts) - 1 for g in opt.param_groups for p in g["params"])
    assert moment_bytes_per_parameter(engine) == pytest.approx(2 + 8 * blocks / numel)
    assert moment_bytes_per_parameter(engine) < 2.2  # fp32 moments: 8
    # the Trainer's hyper-parameters; its decay groups: the norms (1-D, 16 elements each) take none
    assert {(g["initial_lr"], g["betas"], g["eps"]) for g in opt.param_groups} == {
        (1e-3, (0.8, 0.95), 1e-7)
    }
    decay = {g["weight_decay"]: sum(p.numel() for p in g["params"]) for g in opt.param_groups}
    assert decay == {0.1: numel - 3 * 16, 0.0: 3 * 16}


def test_the_default_optim_keeps_fp32_moments(tmp_path):
    assert moment_bytes_per_parameter(train(tmp_path)) == 8.0


@pytest.mark.parametrize(
    "optim, optim_args, state_dtype",
    [
        ("adamw_anyprecision", "momentum_dtype=bfloat16,variance_dtype=bfloat16", "bf16"),
        ("adamw_anyprecision", None, "fp32"),
        (
            "paged_adamw_32bit",
            None,
            "fp32",
        ),  # bitsandbytes' paged AdamW: the same math, fp32 states
    ],
)
def test_anyprecision_and_paged_adamw_store_the_moments_they_name(
    optim, optim_args, state_dtype, tmp_path
):
    """Served without torchdistx or bitsandbytes (neither is installed here: transformers' own optimizer for these
    names cannot be built)."""
    engine = train(tmp_path, optim=optim, optim_args=optim_args)
    assert getattr(engine.optimizer.optimizer, "state_dtype", "fp32") == state_dtype
    assert moment_bytes_per_parameter(engine) == {"bf16": 4.0, "fp32": 8.0}[state_dtype]
    assert {g["initial_lr"] for g in engine.optimizer.optimizer.param_groups} == {1e-3}


@pytest.mark.parametrize("name", ["lion_8bit", "adamw_torch_4bit", "adafactor", "galore_adamw"])
def test_a_name_plait_does_not_serve_is_refused_by_name_with_the_fix(name, tmp_path):
    with pytest.raises(ConfigError) as err:
        train(
            tmp_path,
            optim=name,
            **({"optim_target_modules": ["mlp"]} if name.startswith("galore") else {}),
        )
    assert f"optim={name!r}" in str(err.value) and REFUSED[name] in str(err.value)
    assert "adamw_torch" in str(err.value)


def test_mixed_anyprecision_dtypes_are_refused_naming_them(tmp_path):
    with pytest.raises(ConfigError, match="momentum_dtype=bfloat16 and variance_dtype=float32"):
        train(tmp_path, optim="adamw_anyprecision", optim_args="momentum_dtype=bfloat16")


def test_a_config_optimizer_wins_over_optim_and_says_so_once(tmp_path, caplog):
    config = {**ZERO2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    with caplog.at_level(logging.INFO, logger="plait"):
        engine = train(tmp_path, config=config, optim="adamw_bnb_8bit")
    assert moment_bytes_per_parameter(engine) == 8.0
    said = [
        r.getMessage()
        for r in caplog.records
        if "optim" in r.getMessage() and "wins" in r.getMessage()
    ]
    assert said == [
        (
            'TrainingArguments.optim = adamw_bnb_8bit is not used: the ds_config\'s "optimizer" section '
            "(AdamW) wins, as under DeepSpeed"
        )
    ]


def test_an_optimizer_the_script_passes_wins_over_optim(tmp_path):
    """``Trainer(optimizers=(opt, None))``: transformers' ``create_optimizer`` returns it whatever ``optim`` says;
    so does plait (the engine reuses its class and groups: torch's AdamW, fp32 moments)."""
    engine = train(
        tmp_path,
        optim="adamw_8bit",
        optimizers=lambda model: (torch.optim.AdamW(model.parameters(), lr=1e-3), None),
    )
    assert moment_bytes_per_parameter(engine) == 8.0
    assert isinstance(engine.optimizer.optimizer, torch.optim.AdamW)
