"""plait.config: reading DeepSpeed-style JSON into typed, resolved dataclasses (batch sizes: test_config_batch.py;
keys accepted or refused: test_config_keys.py)."""

import copy
import json
from pathlib import Path

import pytest

from plait.config import ConfigError, PlaitConfig, load_config

# The ZeRO-2 + CPU offload config Hugging Face users pass to the Trainer (every "auto" the Trainer fills).
SEED = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "configs"


def _seed_config(**overrides):
    kwargs = dict(
        dp_size=8,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-6,
        weight_decay=0.1,
        warmup_num_steps=100,
    )
    kwargs.update(overrides)
    return load_config(SEED, **kwargs)


def test_seed_config_loads_and_resolves_every_auto():
    cfg = _seed_config(mixed_precision="fp16")
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == (64, 4, 2)
    assert cfg.data_parallel_size == 8
    assert cfg.fp16.enabled and cfg.fp16.dynamic and cfg.fp16.initial_scale_power == 16
    assert not cfg.bf16.enabled and cfg.precision == "fp16"
    assert cfg.gradient_clipping == 1.0
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params == {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-6,
        "weight_decay": 0.1,
        "bias_correction": True,
        "adam_w_mode": True,
        "state_dtype": "fp32",
    }
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 100,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    }
    z = cfg.zero_optimization
    assert z.stage == 2 and z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert z.reduce_bucket_size == 200_000_000 and isinstance(z.reduce_bucket_size, int)
    assert z.allgather_bucket_size == 200_000_000 and not z.offload_param.enabled
    assert cfg.steps_per_print == 2000 and cfg.wall_clock_breakdown is False


def test_seed_config_example_file_matches_and_source_is_not_modified():
    original = copy.deepcopy(SEED)
    assert json.loads((EXAMPLES / "zero2_offload_hf.json").read_text()) == SEED
    path_cfg = load_config(
        EXAMPLES / "zero2_offload_hf.json",
        dp_size=8,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        warmup_num_steps=10,
        lr=1e-4,
    )
    assert path_cfg == load_config(
        SEED,
        dp_size=8,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        warmup_num_steps=10,
        lr=1e-4,
    )
    assert SEED == original


def test_auto_without_facts_uses_documented_defaults():
    cfg = _seed_config(lr=2e-5, betas=None, eps=None, weight_decay=None)
    assert not cfg.fp16.enabled and not cfg.bf16.enabled and cfg.precision == "fp32"
    assert cfg.optimizer.params["lr"] == 2e-5 and cfg.optimizer.params["betas"] == (0.9, 0.999)
    assert cfg.optimizer.params["eps"] == 1e-8 and cfg.optimizer.params["weight_decay"] == 0.0
    assert cfg.scheduler.params["warmup_max_lr"] == 2e-5  # follows the optimizer's lr
    # a learning rate has no default (the Trainer's is 5e-5, torch AdamW's 1e-3): "auto" needs the fact
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr.*pass lr="):
        _seed_config(lr=None)
    with pytest.raises(
        ConfigError, match=r"scheduler\.params\.warmup_num_steps.*warmup_num_steps="
    ):
        _seed_config(warmup_num_steps=None)


def test_zero_auto_buckets_from_hidden_size():
    raw = {
        "train_batch_size": 16,
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": "auto",
        },
    }
    cfg = load_config(raw, dp_size=4, model_hidden_size=4096, mixed_precision="bf16")
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 4096 * 4096 == 16_777_216
    assert z.stage3_prefetch_bucket_size == 15_099_494  # int(0.9 * 4096 * 4096)
    assert z.stage3_param_persistence_threshold == 40_960
    assert z.stage3_gather_16bit_weights_on_model_save is False
    assert z.overlap_comm is True  # DeepSpeed's default for stage 3
    stage2 = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}}, dp_size=1)
    assert stage2.zero_optimization.overlap_comm is False
    assert cfg.bf16.enabled and cfg.precision == "bf16"
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 1)
    with pytest.raises(
        ConfigError, match=r"'zero_optimization\.reduce_bucket_size' is \"auto\".*model_hidden_size"
    ):
        load_config(raw, dp_size=4)


def test_deepspeed_spellings_read_as_plaits_keys():
    cfg = load_config(
        {
            "train_batch_size": 8,
            "communication_data_type": "bfp16",
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "max_live_parameters": 5,
                "prefetch_bucket_size": 7,
                "param_persistence_threshold": 9,
                "gather_16bit_weights_on_model_save": True,
            },
        },
        dp_size=1,
    )
    z = cfg.zero_optimization
    assert cfg.communication_data_type == "bf16" and z.offload_optimizer.device == "cpu"
    assert (
        z.stage3_max_live_parameters,
        z.stage3_prefetch_bucket_size,
        z.stage3_param_persistence_threshold,
        z.stage3_gather_16bit_weights_on_model_save,
    ) == (5, 7, 9, True)
    with pytest.raises(ConfigError, match="cpu_offload and offload_optimizer.device differently"):
        load_config(
            {
                "train_batch_size": 8,
                "zero_optimization": {
                    "stage": 2,
                    "cpu_offload": True,
                    "offload_optimizer": {"device": "none"},
                },
            },
            dp_size=1,
        )


def test_fp16_auto_and_bf16_auto_pick_at_most_one():
    raw = {"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    assert load_config(raw, dp_size=1, mixed_precision="bf16").precision == "bf16"
    assert load_config(raw, dp_size=1, mixed_precision="fp16").precision == "fp16"
    assert load_config(raw, dp_size=1).precision == "fp32"


@pytest.mark.parametrize(
    "name",
    ["zero2_offload_hf.json", "zero3_bf16.json", "tp2_pp4_interleaved.json", "fp32_small.json"],
)
def test_round_trip_through_to_dict_and_json(name, tmp_path):
    cfg = (
        load_config(
            EXAMPLES / name,
            world_size=16,
            model_hidden_size=1024,
            micro_batch_size=1,
            gradient_accumulation_steps=1,
            warmup_num_steps=10,
            lr=1e-4,
        )
        if name != "fp32_small.json"
        else load_config(EXAMPLES / name, dp_size=4)
    )
    d = cfg.to_dict()
    path = tmp_path / "meta.json"
    path.write_text(json.dumps(d))
    again = load_config(path)  # all three batch keys present: no dp needed
    assert again == cfg and isinstance(again, PlaitConfig)
    assert again.to_dict() == d


def test_optimizer_and_scheduler_params_are_filled_and_checked():
    cfg = load_config(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "lion", "params": {"lr": 1e-4}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000}},
        },
        dp_size=1,
    )
    assert cfg.optimizer.type == "Lion" and cfg.optimizer.params == {
        "lr": 1e-4,
        "betas": (0.9, 0.99),
        "weight_decay": 0.0,
    }
    assert (
        cfg.scheduler.params["cos_min_ratio"] == 0.0001
        and cfg.scheduler.params["warmup_num_steps"] == 1000
    )
    with pytest.raises(
        ConfigError, match="scheduler type 'WarmupDecayLR' needs params.total_num_steps"
    ):
        load_config(
            {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {}}}, dp_size=1
        )
    with pytest.raises(ConfigError, match="'AdamW' with params.adam_w_mode false"):
        load_config(
            {
                "train_batch_size": 8,
                "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}},
            },
            dp_size=1,
        )


def test_non_json_values_in_a_dict_are_rejected():
    with pytest.raises(ConfigError, match="only JSON values"):
        load_config({"train_batch_size": 8, "seed": object()})


def test_bad_json_file_names_the_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match="ds.json is not valid JSON"):
        load_config(path)
