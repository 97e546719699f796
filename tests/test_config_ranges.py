"""Range checks of config values (``schema_base.bounded`` / ``check_number``), scheduler params first: each value
DeepSpeed's ``lr_schedules`` gives a meaning is accepted, each that silently stops training (an lr stuck at
its floor, a warm-up that never ends) is refused naming the key, the value and the fix."""

import math

import pytest

from plait.config import ConfigError, load_config

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


def _with_scheduler(kind, **params):
    return load_config({**BASE, "scheduler": {"type": kind, "params": params}}, dp_size=1)


@pytest.mark.parametrize(
    "kind, floor", [("WarmupDecayLR", "warmup_min_lr"), ("WarmupCosineLR", "cos_min_ratio")]
)
@pytest.mark.parametrize("total", [5, 0, -100])
def test_a_decay_that_ends_before_the_warm_up_is_refused(kind, floor, total):
    with pytest.raises(ConfigError) as err:
        _with_scheduler(kind, warmup_num_steps=10, total_num_steps=total)
    text = str(err.value)
    if total >= 1:
        assert text.startswith(
            f"scheduler.params.total_num_steps = {total} is below "
            "scheduler.params.warmup_num_steps = 10: the lr would never reach its peak"
        )
        assert f"drop to {floor}" in text and "set total_num_steps to the run's length" in text
    else:
        assert text == (
            f"scheduler.params.total_num_steps = {total} is out of range: it must be an integer >= 1"
        )


def test_the_totals_and_warm_ups_filled_from_auto_are_checked_too():
    auto = {
        **BASE,
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"},
        },
    }
    with pytest.raises(
        ConfigError, match=r"total_num_steps = 3 is below scheduler.params.warmup_num_steps = 4"
    ):
        load_config(auto, dp_size=1, warmup_num_steps=4, total_num_steps=3)
    with pytest.raises(
        ConfigError, match=r"warmup_num_steps = 0 is out of range: it must be an integer >= 1"
    ):
        load_config(auto, dp_size=1, warmup_num_steps=0, total_num_steps=3)


@pytest.mark.parametrize(
    "kind, params",
    [
        ("WarmupLR", {"warmup_num_steps": 500}),  # no total: WarmupLR holds the peak
        ("WarmupLR", {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-3, "warmup_num_steps": 1}),
        (
            "WarmupDecayLR",
            {"warmup_num_steps": 1, "total_num_steps": 1},
        ),  # the Trainer's max_steps=1
        (
            "WarmupDecayLR",
            {"warmup_num_steps": 10, "total_num_steps": 10, "last_batch_iteration": 5},
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": 2000, "warmup_min_ratio": 1.0, "cos_min_ratio": 0.0},
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": 1000, "warmup_min_ratio": 0.0, "cos_min_ratio": 1.0},
        ),
    ],
)
def test_values_deepspeed_gives_a_meaning_are_accepted(kind, params):
    cfg = _with_scheduler(kind, **params)
    assert cfg.scheduler.type == kind and all(
        cfg.scheduler.params[k] == v for k, v in params.items()
    )


@pytest.mark.parametrize(
    "kind, key, value, allowed",
    [
        ("WarmupLR", "warmup_num_steps", 0, "an integer >= 1"),
        ("WarmupLR", "warmup_num_steps", -5, "an integer >= 1"),
        ("WarmupLR", "warmup_max_lr", -1e-3, "a finite number >= 0"),
        ("WarmupLR", "warmup_min_lr", math.nan, "a finite number >= 0"),
        ("WarmupLR", "last_batch_iteration", -2, "an integer >= -1"),
        ("WarmupDecayLR", "warmup_max_lr", math.inf, "a finite number >= 0"),
        ("WarmupCosineLR", "cos_min_ratio", 1.5, "a finite number in [0, 1]"),
        ("WarmupCosineLR", "warmup_min_ratio", -0.1, "a finite number in [0, 1]"),
    ],
)
def test_scheduler_params_out_of_range_are_refused_naming_key_value_and_range(
    kind, key, value, allowed
):
    params = {"total_num_steps": 1000, key: value} if kind != "WarmupLR" else {key: value}
    with pytest.raises(ConfigError) as err:
        _with_scheduler(kind, **params)
    assert (
        str(err.value)
        == f"scheduler.params.{key} = {value!r} is out of range: it must be {allowed}"
    )


def test_a_warm_up_that_would_lower_the_lr_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"warmup_min_lr = 0.01 is above scheduler.params.warmup_max_lr = 0.001: "
        r"the warm-up would lower the lr; make warmup_min_lr <= warmup_max_lr",
    ):
        _with_scheduler("WarmupDecayLR", warmup_min_lr=1e-2, warmup_max_lr=1e-3, total_num_steps=10)


@pytest.mark.parametrize(
    "raw, message",
    [
        # 2**(10**30) never finishes; DeepSpeed's scale is a power of two of fp32
        (
            {"fp16": {"enabled": True, "initial_scale_power": 1e30}},
            "fp16.initial_scale_power = 1e+30 is out of range: it must be an integer in [0, 127]",
        ),
        (
            {"fp16": {"enabled": True, "hysteresis": 0}},
            "fp16.hysteresis = 0 is out of range: it must be an integer >= 1",
        ),
        (
            {"fp16": {"loss_scale": -1}},
            "fp16.loss_scale = -1.0 is out of range: it must be a finite number >= 0",
        ),
        (
            {"fp16": {"min_loss_scale": 0}},
            "fp16.min_loss_scale = 0.0 is out of range: it must be a finite number > 0",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": -1}},
            "zero_optimization.reduce_bucket_size = -1 is out of range: it must be an integer >= 0",
        ),
        (
            {"zero_optimization": {"max_live_parameters": -1}},
            "zero_optimization.stage3_max_live_parameters (or max_live_parameters) = -1 is out of range",
        ),
        (
            {"seed": 1e30},
            "seed = 1e+30 is out of range: it must be an integer of 64 bits (|value| < 2**63)",
        ),
        ({"steps_per_print": math.inf}, "'steps_per_print' must be an integer, got float inf"),
        (
            {
                "optimizer": {
                    "type": "LAMB",
                    "params": {"lr": 1e-3, "min_coeff": 2.0, "max_coeff": 1.0},
                }
            },
            "optimizer.params.min_coeff = 2.0 is above optimizer.params.max_coeff = 1.0",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"lr": 1e-3, "nesterov": True}}},
            "optimizer.params.nesterov = true needs momentum > 0 and dampening 0, got momentum 0.0",
        ),
        (
            {"pipeline": {"stages": 0}},
            "pipeline.size (or stages) = 0 is out of range: it must be an integer >= 1",
        ),
        (
            {"activation_checkpointing": {"number_checkpoints": -1}},
            "activation_checkpointing.number_checkpoints = -1 is out of range: it must be an integer >= 0",
        ),
    ],
)
def test_every_number_is_finite_within_64_bits_and_its_range(raw, message):
    with pytest.raises(ConfigError) as err:
        load_config({**BASE, **raw}, dp_size=1)
    assert message in str(err.value)


def test_deepspeeds_zero_sizes_of_0_are_accepted_and_an_alias_is_named_as_written():
    cfg = load_config(
        {
            **BASE,
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": 0,
                "prefetch_bucket_size": 0,
                "stage3_param_persistence_threshold": 0,
            },
        },
        dp_size=1,
    )
    assert (
        cfg.zero_optimization.reduce_bucket_size,
        cfg.zero_optimization.stage3_prefetch_bucket_size,
    ) == (0, 0)
    with pytest.raises(
        ConfigError,
        match=r"^'bfloat16' does not accept \"auto\"; write a JSON object \(a section\)$",
    ):
        load_config({**BASE, "bfloat16": "auto"}, dp_size=1)
    with pytest.raises(
        ConfigError, match="'zero_optimization.stage3_gather_fp16_weights_on_model_save' must be a"
    ):
        load_config(
            {**BASE, "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": [1]}},
            dp_size=1,
        )
