"""plait.config: which keys are read, which are refused (unknown, misspelt, not implemented, changing training),
which are accepted with a notice or silently, and how values are type-checked."""

import pytest

from plait.config import ConfigError, UnsupportedConfigError, load_config


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"gradient_acumulation_steps": 2},
            "unknown key 'gradient_acumulation_steps' in config; did you mean 'gradient_accumulation_steps'?",
        ),
        (
            {"zero_optimization": {"stage": 2, "overlap_com": True}},
            "unknown key 'overlap_com' in 'zero_optimization'; did you mean 'overlap_comm'?",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "cpu", "pin_memroy": True},
                }
            },
            "unknown key 'pin_memroy' in 'zero_optimization.offload_param'; did you mean 'pin_memory'?",
        ),
        (
            {"fp16": {"enabled": True, "loss_scale_windw": 100}},
            "unknown key 'loss_scale_windw' in 'fp16'; did you mean 'loss_scale_window'?",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decy": 0.1}}},
            "unknown key 'weight_decy' in 'optimizer.params'; did you mean 'weight_decay'?",
        ),
        (
            {
                "scheduler": {
                    "type": "WarmupLR",
                    "params": {"warmup_max_lr": 1e-3, "warmup_num_step": 5},
                }
            },
            "unknown key 'warmup_num_step' in 'scheduler.params'; did you mean 'warmup_num_steps'?",
        ),
        (
            {"optimizer": {"type": "AdamWW"}},
            "unknown optimizer type 'AdamWW'; did you mean 'AdamW'?",
        ),
        ({"stage": 3}, "unknown key 'stage' in config; 'stage' belongs in 'zero_optimization'"),
    ],
)
def test_misspelt_keys_suggest_the_closest_valid_key(raw, message):
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert message in str(err.value)
    assert not isinstance(err.value, UnsupportedConfigError)


@pytest.mark.parametrize(
    "raw, names",
    [
        ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, "'progressive_layer_drop'"),
        (
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            "'bf16_master_weights_and_grads'",
        ),
        ({"tensor_parallel": {"autotp_size": 2}}, "'autotp_size'"),
        ({"comet": {"enabled": True}}, "'comet'"),
        ({"amp": {"enabled": True}}, "'amp'"),
        ({"sparse_attention": {"mode": "fixed"}}, "'sparse_attention'"),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                }
            },
            "nvme",
        ),
        (
            {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
            "'zero_quantized_weights'",
        ),
        ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "'zenflow'"),
        ({"optimizer": {"type": "OneBitAdam", "params": {}}}, "'OneBitAdam'"),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, "'OneCycle'"),
    ],
)
def test_unimplemented_deepspeed_features_are_rejected(raw, names):
    with pytest.raises(UnsupportedConfigError, match="plait does not implement") as err:
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert names in str(err.value)
    assert isinstance(err.value, ValueError)


def test_unimplemented_sections_written_as_off_are_accepted():
    raw = {
        "train_batch_size": 8,
        "flops_profiler": {"enabled": False, "profile_step": 1},
        "tensorboard": {"enabled": False},
        "zero_optimization": {"stage": 3, "zero_quantized_weights": False, "mics_shard_size": -1},
    }
    assert load_config(raw, dp_size=1).zero_optimization.stage == 3


@pytest.mark.parametrize(
    "raw, notice",
    [
        ({"flops_profiler": {"enabled": True, "profile_step": 1}}, "no FLOPs profile is printed"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "hpZ"),
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "MiCS"),
        (
            {"data_types": {"grad_accum_dtype": "bf16"}},
            "plait accumulates gradients in fp32, not bf16",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "offloaded at stage 3 only",
        ),
        (
            {"cuda_visible_devices": "0,1"},
            "'cuda_visible_devices' is not read by plait or DeepSpeed",
        ),
    ],
)
def test_keys_that_do_not_change_training_are_accepted_with_a_notice(raw, notice, caplog):
    cfg = load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert notice in caplog.text
    assert (
        not cfg.zero_optimization.offload_param.enabled
    )  # DeepSpeed offloads parameters at stage 3 only


@pytest.mark.parametrize(
    "raw",
    [
        {"compile": {"deepcompile": False, "free_activation": True}},
        {"data_types": {"grad_accum_dtype": None}},
        {"data_types": {"grad_accum_dtype": "fp32"}},
        {"checkpoint": {"load_universal": False}},
        {"aio": {"block_size": 1048576, "queue_depth": 8}},
        {"_comment": "any text"},
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "fused": True}}},
        {"zero_optimization": {"stage": 2, "round_robin_gradients": True}},
        {"flops_profiler": {"enabled": False}},
        {"comms_logger": {"enabled": False}},
    ],
)
def test_keys_in_their_off_or_internal_form_are_accepted_silently(raw, caplog):
    load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert caplog.text == ""


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"steps_per_print": "10"}, "'steps_per_print' must be an integer, got str '10'"),
        ({"steps_per_print": 2.5}, "'steps_per_print' must be an integer, got float 2.5"),
        (
            {"wall_clock_breakdown": 1},
            "'wall_clock_breakdown' must be a boolean (true/false), got int 1",
        ),
        ({"zero_optimization": {"stage": True}}, "'zero_optimization.stage' must be an integer"),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
            "'optimizer.params.betas' must be a list of 2 numbers, got list [0.9]",
        ),
        ({"pipeline": {"schedule": "1f1f"}}, "did you mean '1f1b'?"),
        ({"zero_optimization": "yes"}, "'zero_optimization' must be a JSON object"),
        (
            {"steps_per_print": "auto"},
            "'steps_per_print' does not accept \"auto\"; write an integer",
        ),
    ],
)
def test_values_are_type_checked(raw, message):
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "fp16.enabled and bf16.enabled are both true",
        ),
        (
            {"zero_optimization": {"stage": 4}},
            "zero_optimization.stage must be 0, 1, 2 or 3, got 4",
        ),
        (
            {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            "offload_optimizer needs stage 1, 2 or 3",
        ),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "sets 'bf16' twice"),
    ],
)
def test_cross_field_rules(raw, message):
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}}}, "'amsgrad'"),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
            "'max_grad_norm'",
        ),
        ({"sequence_parallel_size": 4}, "'sequence_parallel_size'"),
        ({"zero_optimization": {"stage": 1, "legacy_stage1": True}}, "'legacy_stage1'"),
    ],
)
def test_keys_that_change_training_are_refused_when_on_and_accepted_off(raw, key):
    with pytest.raises(UnsupportedConfigError, match=key):
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    off = {
        "amsgrad": False,
        "max_grad_norm": 0.0,
        "sequence_parallel_size": 1,
        "legacy_stage1": False,
    }
    name = key.strip("'")
    load_config(_with(raw, name, off[name]), dp_size=1)


def _with(raw, key, value):
    import copy

    out = copy.deepcopy(raw)
    for node in (out.get("optimizer", {}).get("params"), out.get("zero_optimization"), out):
        if isinstance(node, dict) and key in node:
            node[key] = value
            break
    return {"train_batch_size": 8, **out}
