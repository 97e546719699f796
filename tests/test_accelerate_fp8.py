"""accelerate's fp8 on plait (``plait.accelerate.fp8``): ``Accelerator(mixed_precision="fp8",
kwargs_handlers=[AORecipeKwargs()])`` (accelerate's torchao backend) or ``ACCELERATE_MIXED_PRECISION=fp8``, with
accelerate's own ZeRO-2 test config, trains an unmodified tiny Hugging Face Llama through plait's engine with
its ``nn.Linear`` layers as torchao ``Float8Linear`` (CPU: torchao's emulation). The layers converted are the
ones accelerate's own ``convert_model_to_fp8_ao`` converts (its default filter, and a custom filter), and the
losses equal, bit for bit, those of the same script with the ``fp8`` section written in the ds_config (the
same conversion, so the same arithmetic). TransformerEngine, MS-AMP, custom torchao configs and a ds_config
that asks otherwise are refused by name. Before: ``mixed_precision="fp8"`` was refused ("fp8 mixed precision /
MS-AMP is not served")."""

import copy
import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import AORecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
from accelerate.utils.ao import convert_model_to_fp8_ao
from torch.utils.data import DataLoader
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear
from transformers import LlamaConfig, LlamaForCausalLM

from plait.accelerate import Accelerator, DeepSpeedPlugin, DummyOptim, DummyScheduler
from plait.config import ConfigError

ACCEL_Z2 = Path(__file__).parent / "data" / "ds_configs" / "accelerate__ds_config_zero2.json"
#: the tiny Llama's 15 linear layers: 7 per block, 2 blocks, and lm_head
FIRST, LAST = "model.layers.0.self_attn.q_proj", "lm_head"


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )


def ds_config(**extra) -> dict:
    return {**json.loads(ACCEL_Z2.read_text()), **extra}


def float8_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def train(accelerator, model, steps: int = 4) -> tuple[list[float], object]:
    """accelerate's training loop as its docs write it (DummyOptim/DummyScheduler: the config's optimizer)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=g).repeat(steps, 1)  # one batch, seen each step
    data = DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=2)
    optimizer = DummyOptim(model.parameters(), lr=1e-2)
    lr_scheduler = DummyScheduler(optimizer, warmup_num_steps=0)
    model, optimizer, data, lr_scheduler = accelerator.prepare(model, optimizer, data, lr_scheduler)
    losses = []
    for batch in data:
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.fixture(scope="module")
def runs():
    """The same script three ways: accelerate's fp8 (AORecipeKwargs), the fp8 section in the ds_config
    (accelerate's first/last layers excluded), and plain bf16."""
    out = {}
    ways = {
        "accelerate_fp8": ({}, {"mixed_precision": "fp8", "kwargs_handlers": [AORecipeKwargs()]}),
        "ds_config_fp8": (
            {"fp8": {"enabled": True, "recipe": "tensorwise", "exclude": [FIRST, LAST]}},
            {"mixed_precision": "bf16"},
        ),
        "bf16": ({}, {"mixed_precision": "bf16"}),
    }
    for name, (extra, kwargs) in ways.items():
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config(**extra))
        try:
            accelerator = Accelerator(deepspeed_plugin=plugin, cpu=True, **kwargs)
            losses, engine = train(accelerator, llama())
            out[name] = {
                "losses": losses,
                "float8": float8_names(engine.module),
                "ds_config": accelerator.deepspeed_plugin.deepspeed_config,
                "mixed_precision": accelerator.mixed_precision,
                "backend": str(accelerator.fp8_backend.value),
            }
        finally:
            AcceleratorState._reset_state(True)
    return out


def test_accelerate_fp8_trains_in_float8_as_the_ds_configs_fp8_section(runs):
    ours, direct, bf16 = runs["accelerate_fp8"], runs["ds_config_fp8"], runs["bf16"]
    assert len(ours["float8"]) == 13 and FIRST not in ours["float8"] and LAST not in ours["float8"]
    assert ours["ds_config"]["fp8"] == {
        "enabled": True,
        "recipe": "tensorwise",
        "exclude": [FIRST, LAST],
    }
    assert ours["ds_config"]["bf16"]["enabled"] is True and not ours["ds_config"]["fp16"]["enabled"]
    assert ours["mixed_precision"] == "fp8" and ours["backend"] == "AO"
    assert ours["losses"] == direct["losses"]  # bit for bit: the same conversion and arithmetic
    assert ours["float8"] == direct["float8"]
    assert ours["losses"] != bf16["losses"] and bf16["float8"] == []  # float8 is really computed
    assert ours["losses"][-1] < ours["losses"][0], ours["losses"]


@pytest.mark.parametrize("custom", [False, True])
def test_the_layers_converted_are_accelerates(custom):
    """plait's conversion of the section built from a handler converts the same layers as accelerate's own
    ``convert_model_to_fp8_ao`` with that handler (default filter: first and last layers; a custom
    ``module_filter_func``), on the same model."""
    handler = AORecipeKwargs(
        config=Float8LinearConfig.from_recipe_name("rowwise"),
        module_filter_func=(lambda m, fqn: "mlp" in fqn) if custom else None,
    )
    theirs = llama()
    convert_model_to_fp8_ao(
        theirs, config=handler.config, module_filter_func=handler.module_filter_func
    )
    try:
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config()),
            cpu=True,
            mixed_precision="fp8",
            kwargs_handlers=[handler],
        )
        _, engine = train(accelerator, llama(), steps=1)
        section = accelerator.deepspeed_plugin.deepspeed_config["fp8"]
    finally:
        AcceleratorState._reset_state(True)
    assert section["recipe"] == "rowwise"
    assert float8_names(engine.module) == float8_names(theirs)
    assert len(float8_names(theirs)) == (6 if custom else 13)


def test_the_environment_asks_for_fp8_as_accelerate_launch_writes_it(monkeypatch):
    """``accelerate launch --use_deepspeed --mixed_precision fp8 --fp8_backend ao``'s environment: no handler,
    accelerate's default AORecipeKwargs (torchao's tensorwise recipe)."""
    config = Path(__file__).parent / "data" / "ds_configs" / "accelerate__ds_config_zero2.json"
    for key, value in {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config),
        "ACCELERATE_MIXED_PRECISION": "fp8",
        "ACCELERATE_FP8_BACKEND": "ao",
    }.items():
        monkeypatch.setenv(key, value)
    try:
        accelerator = Accelerator(cpu=True)
        losses, engine = train(accelerator, llama(), steps=2)
        section = accelerator.deepspeed_plugin.deepspeed_config["fp8"]
    finally:
        AcceleratorState._reset_state(True)
    assert section == {"enabled": True, "recipe": "tensorwise", "exclude": [FIRST, LAST]}
    assert len(float8_names(engine.module)) == 13 and len(losses) == 2


def _te_handler():
    """A TERecipeKwargs as a user with TransformerEngine installed holds (its __post_init__ needs the package)."""
    return TERecipeKwargs.__new__(TERecipeKwargs)


@pytest.mark.parametrize(
    "env, kwargs, match",
    [
        (
            {},
            {"kwargs_handlers": [MSAMPRecipeKwargs()]},
            (
                r"fp8 through MSAMPRecipeKwargs \(TransformerEngine / MS-AMP\) is not served; plait serves "
                r"accelerate's torchao backend \(AO\): Accelerator\(mixed_precision='fp8', "
                r"kwargs_handlers=\[AORecipeKwargs\(\)\]\)"
            ),
        ),
        ({}, {"kwargs_handlers": "te"}, "fp8 through TERecipeKwargs"),
        ({"ACCELERATE_FP8_BACKEND": "TE"}, {}, "fp8 through ACCELERATE_FP8_BACKEND=TE"),
        ({"ACCELERATE_FP8_BACKEND": "MSAMP"}, {}, "ACCELERATE_FP8_BACKEND=MSAMP.*--fp8_backend ao"),
        ({}, {"plugin": {"enable_msamp": True}}, r"MS-AMP \(DeepSpeedPlugin enable_msamp\)"),
        (
            {},
            {"kwargs_handlers": [AORecipeKwargs(config=Float8LinearConfig(emulate=True))]},
            None,
        ),
        (
            {},
            {
                "kwargs_handlers": [
                    AORecipeKwargs(config=Float8LinearConfig(round_scales_to_power_of_2=True))
                ]
            },
            (
                r"custom Float8LinearConfig, none of torchao's named recipes \(tensorwise, rowwise, "
                r"rowwise_with_gw_hp\); it differs from 'tensorwise' in round_scales_to_power_of_2=True"
            ),
        ),
        (
            {},
            {"mixed_precision": "bf16", "kwargs_handlers": [AORecipeKwargs()]},
            r"AORecipeKwargs with mixed_precision='bf16': pass mixed_precision='fp8'",
        ),
    ],
    ids=[
        "msamp_handler",
        "te_handler",
        "te_env",
        "msamp_env",
        "plugin_enable_msamp",
        "emulate_is_no_recipe_field",
        "custom_config",
        "handler_without_fp8",
    ],
)
def test_what_plait_does_not_serve_is_refused_by_name(monkeypatch, env, kwargs, match):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    handlers = kwargs.pop("kwargs_handlers", [])
    handlers = [_te_handler()] if handlers == "te" else handlers
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(), **kwargs.pop("plugin", {}))
    kwargs = {"mixed_precision": "fp8", **kwargs, "kwargs_handlers": handlers}
    try:
        if match is None:  # emulate is plait's choice (by device), not the recipe: accepted
            assert Accelerator(deepspeed_plugin=plugin, cpu=True, **kwargs).fp8_request.recipe == (
                "tensorwise"
            )
            return
        with pytest.raises(ConfigError, match=match):
            Accelerator(deepspeed_plugin=plugin, cpu=True, **kwargs)
    finally:
        AcceleratorState._reset_state(True)


def test_a_ds_config_fp8_section_that_asks_otherwise_is_refused_naming_both():
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(fp8={"enabled": True, "recipe": "rowwise"}))
    try:
        accelerator = Accelerator(
            deepspeed_plugin=plugin,
            cpu=True,
            mixed_precision="fp8",
            kwargs_handlers=[AORecipeKwargs()],
        )
        with pytest.raises(
            ConfigError,
            match=r"""the ds_config's "fp8" section \{'enabled': True, 'recipe': 'rowwise'\} and """
            r"accelerate's fp8 request \(AORecipeKwargs: \{'recipe': 'tensorwise', 'exclude': "
            r"\['model.layers.0.self_attn.q_proj', 'lm_head'\]\}\) ask for different float8 training",
        ):
            train(accelerator, copy.deepcopy(llama()), steps=1)
    finally:
        AcceleratorState._reset_state(True)
