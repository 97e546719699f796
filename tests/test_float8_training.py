"""Float8 training from the ds_config (``fp8``) under torchao's CPU emulation: the section and its refusals, the
devices refused, the conversion of Hugging Face and plait models (exclusions, unaligned layers), and the engine
(ZeRO-2/3 as a hand-converted torchao model, checkpoints, compile, the Trainer). The layers' parity with torchao's
``Float8Linear`` at tp 1 and 2 is tests/test_float8.py's."""

import copy
import glob
import os

import pytest
import torch
from torch import nn

from torchao.float8 import convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear

import plait
from plait.config import ConfigError, load_config
from plait.layers import TransformerModel
from plait.layers.linear import ColumnParallelLinear
from plait.parallel import ParallelMesh
from plait.precision.float8 import check_float8_device, convert_to_float8, excluded, torchao_config
from plait.precision.float8_layers import Float8ColumnParallelLinear, Float8RowParallelLinear
from plait.config.schema_fp8 import FP8Config
from helpers import micro_batch, tiny


# ---------------------------------------------------------------------------------------------- the config
BASE = {
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
}


def test_the_fp8_section_reads_and_round_trips():
    cfg = load_config(
        {
            **BASE,
            "fp8": {"enabled": True, "recipe": "rowwise", "exclude": ["lm_head", "model.layers.0"]},
        }
    )
    assert cfg.fp8 == FP8Config(True, "rowwise", ["lm_head", "model.layers.0"])
    assert load_config(cfg.to_dict()) == cfg
    assert load_config(BASE).fp8 == FP8Config(False, "tensorwise", ["lm_head"])


@pytest.mark.parametrize(
    "section, tp, match",
    [
        (
            {"recipe": "rowise"},
            1,
            r"'fp8.recipe' must be one of 'tensorwise', 'rowwise', 'rowwise_with_gw_hp', got str "
            r"'rowise'; did you mean 'rowwise'\?",
        ),
        (
            {"recipe": "delayed"},
            1,
            r"'fp8.recipe' must be one of 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'",
        ),
        ({"exclude": "lm_head"}, 1, r"'fp8.exclude' must be a list of strings, got str 'lm_head'"),
        (
            {"exclude": [""]},
            1,
            r"fp8.exclude holds \[''\]: each entry must be a non-empty module-name pattern",
        ),
        ({"enable": True}, 1, r"unknown key 'enable' in 'fp8'; did you mean 'enabled'\?"),
        (
            {"enabled": True, "recipe": "rowwise"},
            2,
            r"fp8.recipe 'rowwise' with tensor_parallel.size 2: .* set fp8.recipe "
            r"\"tensorwise\" or tensor_parallel.size 1",
        ),
    ],
)
def test_bad_fp8_sections_are_refused_naming_the_key(section, tp, match):
    with pytest.raises(ConfigError, match=match):
        load_config({**BASE, "fp8": section, "tensor_parallel": {"size": tp}})


def test_a_direct_fp8config_with_an_unknown_recipe_names_the_valid_ones():
    with pytest.raises(
        ConfigError,
        match="fp8.recipe = 'mxfp8' is not a torchao float8 recipe; use one of "
        "tensorwise, rowwise, rowwise_with_gw_hp",
    ):
        FP8Config(True, "mxfp8")


def test_gpus_without_float8_are_refused_by_name():
    with pytest.raises(
        ConfigError,
        match=r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\) has no float8 matmuls; "
        r"float8 training needs compute capability 8.9 or higher",
    ):
        check_float8_device("cuda", (8, 0), "NVIDIA A100-SXM4-80GB")
    assert (
        check_float8_device("cuda", (9, 0), "NVIDIA H200") is False
    )  # hardware float8, no emulation
    assert check_float8_device("cuda", (8, 9), "NVIDIA L40S") is False
    assert check_float8_device("cpu") is True  # torchao's emulation
    with pytest.raises(ConfigError, match="not on 'mps'"):
        check_float8_device("mps")
    with pytest.raises(ConfigError, match=r"GeForce GTX 1080 \(compute capability 6.1\)"):
        convert_to_float8(
            nn.Linear(16, 16),
            FP8Config(True),
            torch.device("cuda"),
            capability=(6, 1),
            device_name="GeForce GTX 1080",
        )


# ---------------------------------------------------------------------------------------------- conversion
def hf_llama(intermediate: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=intermediate,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )


def test_exclude_patterns_and_unaligned_layers_stay_in_high_precision(caplog):
    model = hf_llama(intermediate=72)  # 72 is no multiple of 16: the MLP stays in high precision
    report = convert_to_float8(
        model,
        FP8Config(True, exclude=["lm_head", "model.layers.0", "no_such"]),
        torch.device("cpu"),
    )
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {n for n, k in kinds.items() if k == "Float8Linear"} == {
        f"model.layers.1.self_attn.{p}_proj" for p in "qkvo"
    }
    assert sorted(report["unaligned"]) == [
        f"model.layers.1.mlp.{p}_proj" for p in ("down", "gate", "up")
    ]
    assert (
        sorted(report["excluded"])[-1] == "model.layers.0.self_attn.v_proj"
        and "lm_head" in report["excluded"]
    )
    assert "fp8.exclude pattern 'no_such' matches no linear layer" in caplog.text
    assert (
        "4 linear layer(s) compute in float8 (torchao recipe 'tensorwise'), emulated on the CPU"
        in caplog.text
    )


def test_plait_models_convert_their_parallel_and_fused_layers():
    model = TransformerModel(tiny(fused_projections=True), None, seed=3)
    before = {n: p for n, p in model.named_parameters()}
    report = convert_to_float8(
        model, FP8Config(True, exclude=["layers.1.attn"]), torch.device("cpu")
    )
    assert sorted(report["converted"]) == [
        "layers.1.mlp.down_proj",
        "layers.1.mlp.gate_up_proj",
        "layers.2.attn.o_proj",
        "layers.2.attn.qkv_proj",
        "layers.2.mlp.down_proj",
        "layers.2.mlp.gate_up_proj",
    ]
    assert isinstance(model.layers["2"].attn.qkv_proj, Float8ColumnParallelLinear)
    assert type(model.layers["1"].attn.qkv_proj) is ColumnParallelLinear
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(
        after[n] is before[n] for n in before
    )  # names and tensors kept


def test_excluded_matches_a_module_or_one_containing_it_at_any_depth():
    assert excluded("lm_head", ["lm_head"]) == "lm_head"
    assert excluded("model.layers.0.mlp.up_proj", ["layers.0"]) == "layers.0"
    assert excluded("model.layers.10.mlp.up_proj", ["layers.1"]) is None
    assert excluded("0.layers.3.attn.q_proj", ["layers.3.*"]) == "layers.3.*"


# ---------------------------------------------------------------------------------------------- the engine
def ds_config(fp8: bool, optimizer=None, stage: int = 2, **extra) -> dict:
    return {
        **BASE,
        "optimizer": optimizer or {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": stage},
        "fp8": {"enabled": fp8},
        **extra,
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_an_hf_llama_trains_through_the_engine_as_a_hand_converted_torchao_model(stage):
    """Float32, ZeRO-2 and ZeRO-3 (parameters gathered in fp32 for the float8 casts), SGD with momentum, one fixed
    batch for 5 steps: the engine's losses equal those of the
    same model converted by hand with torchao (lm_head left out, as fp8.exclude's default) and trained with
    torch.optim.SGD, bit for bit (the same float8 casts and matmuls; SGD's update is the same arithmetic),
    and fall."""
    model = hf_llama()
    hand = copy.deepcopy(model)
    engine = plait.initialize(model, ds_config(True, stage=stage), mesh=ParallelMesh())
    convert_to_float8_training(
        hand,
        config=torchao_config("tensorwise", emulate=True),
        module_filter_fn=lambda m, fqn: fqn != "lm_head",
    )
    assert (
        isinstance(model.model.layers[0].mlp.up_proj, Float8Linear)
        and type(model.lm_head) is nn.Linear
    )
    opt = torch.optim.SGD(hand.parameters(), lr=0.1, momentum=0.9)
    batch = micro_batch(0, 0, 0, vocab_size=128, seq=16)
    losses, hand_losses = [], []
    for _ in range(5):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        ref = hand(**batch).loss
        ref.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        hand_losses.append(ref.item())
    assert losses == hand_losses
    assert losses[-1] < 0.9 * losses[0], losses


def _safetensors_dtypes(root: str) -> set:
    from safetensors import safe_open

    dtypes = set()
    for path in glob.glob(os.path.join(root, "**", "*.safetensors"), recursive=True):
        with safe_open(path, framework="pt") as f:
            dtypes.update(f.get_slice(k).get_dtype() for k in f.keys())
    return dtypes


def test_checkpoints_stay_in_the_training_dtypes_and_load_without_fp8(tmp_path):
    """bf16 compute with fp32 masters and AdamW: a float8 run's checkpoint holds bf16 and fp32 tensors only (no
    float8 dtype, the parameter names of the high-precision model) and loads into an engine without fp8 to the
    same weights."""
    adamw = {"type": "AdamW", "params": {"lr": 1e-3}}
    f8 = plait.initialize(
        TransformerModel(tiny(), None, seed=3),
        ds_config(True, adamw, bf16={"enabled": True}),
        mesh=ParallelMesh(),
    )
    assert any(isinstance(m, Float8RowParallelLinear) for m in f8.module.modules())
    for step in range(2):
        loss = f8(**micro_batch(step, 0, 0))
        f8.backward(loss)
        f8.step()
    f8.save_checkpoint(str(tmp_path))
    assert _safetensors_dtypes(str(tmp_path)) == {
        "BF16",
        "F32",
    }  # bf16 weights, fp32 masters and moments
    plain = plait.initialize(
        TransformerModel(tiny(), None, seed=4),
        ds_config(False, adamw, bf16={"enabled": True}),
        mesh=ParallelMesh(),
    )
    plain.load_checkpoint(str(tmp_path))
    want, got = f8.module.state_dict(), plain.module.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype == torch.bfloat16 and torch.equal(
            got[name], want[name]
        ), name


def test_compile_and_activation_checkpointing_compute_what_eager_float8_computes():
    """The swap runs before compile traces the blocks and before activation checkpointing marks them: a compiled
    (aot_eager: the same ATen kernels), fully recomputed float8 engine gives the eager float8 engine's losses."""

    def losses(extra: dict) -> list:
        engine = plait.initialize(
            TransformerModel(tiny(), None, seed=3), ds_config(True, **extra), mesh=ParallelMesh()
        )
        out = []
        for step in range(2):
            loss = engine(**micro_batch(step, 0, 0))
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out, engine

    eager, _ = losses({})
    both, engine = losses(
        {
            "compile": {"enabled": True, "backend": "aot_eager"},
            "activation_checkpointing": {"number_checkpoints": 2},
        }
    )
    assert engine.is_compiled and isinstance(
        engine.module.layers["1"].mlp.down_proj, Float8RowParallelLinear
    )
    assert both == eager


def test_the_trainer_passes_the_fp8_section_through(tmp_path):
    """``plait.hf.TrainingArguments(deepspeed={..., "fp8": ...})``: the Trainer's engine converts the model (the
    ds_config reaches ``plait.initialize`` whole) and trains under ZeRO-3."""
    from plait.hf import Trainer, TrainingArguments

    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 3},
        "fp8": {"enabled": True, "recipe": "rowwise"},
    }
    args = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed=config,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    data = [{"input_ids": [i % 64, 2, 3, 4], "labels": [i % 64, 2, 3, 4]} for i in range(8)]
    trainer = Trainer(model=hf_llama(), args=args, train_dataset=data)
    trainer.train()
    up = trainer.model.model.layers[1].mlp.up_proj
    assert (
        isinstance(up, Float8Linear)
        and up.config.cast_config_input.scaling_granularity.value == "axiswise"
    )
    assert type(trainer.model.lm_head) is nn.Linear and trainer.engine.global_steps == 2
