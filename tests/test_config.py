"""plait.config: reading DeepSpeed-style JSON into typed, resolved dataclasses."""
import copy
import json
from pathlib import Path

import pytest

from plait.config import ConfigError, PlaitConfig, UnsupportedConfigError, load_config

# The ZeRO-2 + CPU offload config Hugging Face users pass to the Trainer (every "auto" the Trainer fills).
SEED = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "configs"


def _seed_config(**overrides):
    kwargs = dict(dp_size=8, micro_batch_size=4, gradient_accumulation_steps=2, lr=3e-4, betas=(0.9, 0.95),
                  eps=1e-6, weight_decay=0.1, warmup_num_steps=100)
    kwargs.update(overrides)
    return load_config(SEED, **kwargs)


def test_seed_config_loads_and_resolves_every_auto():
    cfg = _seed_config(mixed_precision="fp16")
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 4, 2)
    assert cfg.data_parallel_size == 8
    assert cfg.fp16.enabled and cfg.fp16.dynamic and cfg.fp16.initial_scale_power == 16
    assert not cfg.bf16.enabled and cfg.precision == "fp16"
    assert cfg.gradient_clipping == 1.0
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1,
                                    "bias_correction": True, "adam_w_mode": True, "state_dtype": "fp32"}
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100,
                                    "warmup_type": "log", "last_batch_iteration": -1}
    z = cfg.zero_optimization
    assert z.stage == 2 and z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert z.reduce_bucket_size == 200_000_000 and isinstance(z.reduce_bucket_size, int)
    assert z.allgather_bucket_size == 200_000_000 and not z.offload_param.enabled
    assert cfg.steps_per_print == 2000 and cfg.wall_clock_breakdown is False


def test_seed_config_example_file_matches_and_source_is_not_modified():
    original = copy.deepcopy(SEED)
    assert json.loads((EXAMPLES / "zero2_offload_hf.json").read_text()) == SEED
    path_cfg = load_config(EXAMPLES / "zero2_offload_hf.json", dp_size=8, micro_batch_size=4,
                           gradient_accumulation_steps=2, warmup_num_steps=10, lr=1e-4)
    assert path_cfg == load_config(SEED, dp_size=8, micro_batch_size=4, gradient_accumulation_steps=2,
                                   warmup_num_steps=10, lr=1e-4)
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
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_steps.*warmup_num_steps="):
        _seed_config(warmup_num_steps=None)


def test_zero_auto_buckets_from_hidden_size():
    raw = {"train_batch_size": 16, "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "stage3_gather_16bit_weights_on_model_save": "auto"}}
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
    with pytest.raises(ConfigError, match=r"'zero_optimization\.reduce_bucket_size' is \"auto\".*model_hidden_size"):
        load_config(raw, dp_size=4)


@pytest.mark.parametrize("given, dp, expected", [
    ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4}, 8, (256, 4, 8)),
    ({"train_batch_size": 256, "gradient_accumulation_steps": 4}, 8, (256, 8, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}, 8, (256, 4, 8)),
    ({"train_micro_batch_size_per_gpu": 4}, 8, (32, 4, 1)),
    ({"train_batch_size": 64}, 8, (64, 8, 1)),
    ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}, 8,
     (256, 4, 8)),
    ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}, None,
     (256, 4, 8)),
])
def test_batch_triple_derivation(given, dp, expected):
    cfg = load_config(given, dp_size=dp)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected
    assert cfg.data_parallel_size == expected[0] // (expected[1] * expected[2])


def test_batch_triple_inconsistency_names_all_four_numbers_and_the_fix():
    bad = {"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    with pytest.raises(ConfigError) as err:
        load_config(bad, dp_size=8)
    msg = str(err.value)
    for part in ("train_batch_size (100)", "train_micro_batch_size_per_gpu (4)", "gradient_accumulation_steps (8)",
                 "dp (8)", "4 x 8 x 8 = 256 != 100", "change one"):
        assert part in msg, msg
    with pytest.raises(ConfigError, match=r"cannot derive gradient_accumulation_steps.*\(100\).*100 is not "
                                          r"divisible by 4 x 8"):
        load_config({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4}, dp_size=8)
    with pytest.raises(ConfigError, match="pass dp_size="):
        load_config({"train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match="set train_batch_size or train_micro_batch_size_per_gpu"):
        load_config({"gradient_accumulation_steps": 4}, dp_size=2)


def test_dp_from_world_size_and_pipeline_micro_batches():
    raw = {"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"size": 2},
           "pipeline": {"stages": 4, "schedule": "interleaved", "virtual_stages": 2, "micro_batches": 8}}
    cfg = load_config(raw, world_size=32)  # dp = 32 / (2 x 4) = 4
    assert cfg.pipeline.size == 4 and cfg.pipeline.num_chunks == 8
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.pipeline.micro_batches) == (64, 8, 8)
    with pytest.raises(ConfigError, match=r"world_size \(30\) is not divisible by tensor_parallel.size \(2\) x "
                                          r"pipeline.size \(4\)"):
        load_config(raw, world_size=30)
    for m in (6, 3):  # interleaved takes any m >= 1, not only multiples of pipeline.size (m < size: mostly bubble)
        odd = load_config({**raw, "pipeline": {**raw["pipeline"], "micro_batches": m}}, world_size=32)
        assert (odd.train_batch_size, odd.gradient_accumulation_steps, odd.pipeline.micro_batches) == (8 * m, m, m)
    with pytest.raises(ConfigError, match=r"pipeline.micro_batches \(8\) differs from gradient_accumulation_steps "
                                          r"\(2\)"):
        load_config({**raw, "gradient_accumulation_steps": 2}, world_size=32)
    with pytest.raises(ConfigError, match=r"4 strictly increasing layer indices"):
        load_config({"train_batch_size": 8, "pipeline": {"size": 3, "partition": [0, 5, 3, 9]}}, dp_size=1)


@pytest.mark.parametrize("raw, message", [
    ({"gradient_acumulation_steps": 2},
     "unknown key 'gradient_acumulation_steps' in config; did you mean 'gradient_accumulation_steps'?"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}},
     "unknown key 'overlap_com' in 'zero_optimization'; did you mean 'overlap_comm'?"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
     "unknown key 'pin_memroy' in 'zero_optimization.offload_param'; did you mean 'pin_memory'?"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 100}},
     "unknown key 'loss_scale_windw' in 'fp16'; did you mean 'loss_scale_window'?"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decy": 0.1}}},
     "unknown key 'weight_decy' in 'optimizer.params'; did you mean 'weight_decay'?"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_step": 5}}},
     "unknown key 'warmup_num_step' in 'scheduler.params'; did you mean 'warmup_num_steps'?"),
    ({"optimizer": {"type": "AdamWW"}}, "unknown optimizer type 'AdamWW'; did you mean 'AdamW'?"),
    ({"stage": 3}, "unknown key 'stage' in config; 'stage' belongs in 'zero_optimization'"),
])
def test_misspelt_keys_suggest_the_closest_valid_key(raw, message):
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert message in str(err.value)
    assert not isinstance(err.value, UnsupportedConfigError)


@pytest.mark.parametrize("raw, names", [
    ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, "'progressive_layer_drop'"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "'bf16_master_weights_and_grads'"),
    ({"tensor_parallel": {"autotp_size": 2}}, "'autotp_size'"),
    ({"comet": {"enabled": True}}, "'comet'"),
    ({"amp": {"enabled": True}}, "'amp'"),
    ({"sparse_attention": {"mode": "fixed"}}, "'sparse_attention'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}, "nvme"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "'zero_quantized_weights'"),
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "'zenflow'"),
    ({"optimizer": {"type": "OneBitAdam", "params": {}}}, "'OneBitAdam'"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "'OneCycle'"),
])
def test_unimplemented_deepspeed_features_are_rejected(raw, names):
    with pytest.raises(UnsupportedConfigError, match="plait does not implement") as err:
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert names in str(err.value)
    assert isinstance(err.value, ValueError)


def test_unimplemented_sections_written_as_off_are_accepted():
    raw = {"train_batch_size": 8, "flops_profiler": {"enabled": False, "profile_step": 1},
           "tensorboard": {"enabled": False}, "zero_optimization": {"stage": 3, "zero_quantized_weights": False,
                                                                   "mics_shard_size": -1}}
    assert load_config(raw, dp_size=1).zero_optimization.stage == 3


@pytest.mark.parametrize("raw, notice", [
    ({"flops_profiler": {"enabled": True, "profile_step": 1}}, "no FLOPs profile is printed"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "hpZ"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "MiCS"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "plait accumulates gradients in fp32, not bf16"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offloaded at stage 3 only"),
    ({"cuda_visible_devices": "0,1"}, "'cuda_visible_devices' is not read by plait or DeepSpeed"),
])
def test_keys_that_do_not_change_training_are_accepted_with_a_notice(raw, notice, caplog):
    cfg = load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert notice in caplog.text
    assert not cfg.zero_optimization.offload_param.enabled   # DeepSpeed offloads parameters at stage 3 only


@pytest.mark.parametrize("raw", [
    {"compile": {"deepcompile": False, "free_activation": True}}, {"data_types": {"grad_accum_dtype": None}},
    {"data_types": {"grad_accum_dtype": "fp32"}}, {"checkpoint": {"load_universal": False}},
    {"aio": {"block_size": 1048576, "queue_depth": 8}}, {"_comment": "any text"},
    {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "fused": True}}},
    {"zero_optimization": {"stage": 2, "round_robin_gradients": True}},
    {"flops_profiler": {"enabled": False}}, {"comms_logger": {"enabled": False}},
])
def test_keys_in_their_off_or_internal_form_are_accepted_silently(raw, caplog):
    load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert caplog.text == ""


def test_deepspeed_spellings_read_as_plaits_keys():
    cfg = load_config({"train_batch_size": 8, "communication_data_type": "bfp16",
                       "zero_optimization": {"stage": 3, "cpu_offload": True, "max_live_parameters": 5,
                                             "prefetch_bucket_size": 7, "param_persistence_threshold": 9,
                                             "gather_16bit_weights_on_model_save": True}}, dp_size=1)
    z = cfg.zero_optimization
    assert cfg.communication_data_type == "bf16" and z.offload_optimizer.device == "cpu"
    assert (z.stage3_max_live_parameters, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold,
            z.stage3_gather_16bit_weights_on_model_save) == (5, 7, 9, True)
    with pytest.raises(ConfigError, match="cpu_offload and offload_optimizer.device differently"):
        load_config({"train_batch_size": 8, "zero_optimization": {
            "stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "none"}}}, dp_size=1)


def test_a_config_without_batch_sizes_takes_the_callers():
    """The Hugging Face test configs give no batch key at all: the Trainer's batch size is the one."""
    cfg = load_config({"zero_optimization": {"stage": 3}}, dp_size=2, micro_batch_size=4,
                      gradient_accumulation_steps=3)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (24, 4, 3)


@pytest.mark.parametrize("raw, message", [
    ({"steps_per_print": "10"}, "'steps_per_print' must be an integer, got str '10'"),
    ({"steps_per_print": 2.5}, "'steps_per_print' must be an integer, got float 2.5"),
    ({"wall_clock_breakdown": 1}, "'wall_clock_breakdown' must be a boolean (true/false), got int 1"),
    ({"zero_optimization": {"stage": True}}, "'zero_optimization.stage' must be an integer"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
     "'optimizer.params.betas' must be a list of 2 numbers, got list [0.9]"),
    ({"pipeline": {"schedule": "1f1f"}}, "did you mean '1f1b'?"),
    ({"zero_optimization": "yes"}, "'zero_optimization' must be a JSON object"),
    ({"steps_per_print": "auto"}, "'steps_per_print' does not accept \"auto\"; write an integer"),
])
def test_values_are_type_checked(raw, message):
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert message in str(err.value)


@pytest.mark.parametrize("raw, message", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer needs stage 1, 2 or 3"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "sets 'bf16' twice"),
])
def test_cross_field_rules(raw, message):
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    assert message in str(err.value)


def test_fp16_auto_and_bf16_auto_pick_at_most_one():
    raw = {"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    assert load_config(raw, dp_size=1, mixed_precision="bf16").precision == "bf16"
    assert load_config(raw, dp_size=1, mixed_precision="fp16").precision == "fp16"
    assert load_config(raw, dp_size=1).precision == "fp32"


@pytest.mark.parametrize("name", ["zero2_offload_hf.json", "zero3_bf16.json", "tp2_pp4_interleaved.json",
                                  "fp32_small.json"])
def test_round_trip_through_to_dict_and_json(name, tmp_path):
    cfg = load_config(EXAMPLES / name, world_size=16, model_hidden_size=1024, micro_batch_size=1,
                      gradient_accumulation_steps=1, warmup_num_steps=10, lr=1e-4) if name != "fp32_small.json" \
        else load_config(EXAMPLES / name, dp_size=4)
    d = cfg.to_dict()
    path = tmp_path / "meta.json"
    path.write_text(json.dumps(d))
    again = load_config(path)  # all three batch keys present: no dp needed
    assert again == cfg and isinstance(again, PlaitConfig)
    assert again.to_dict() == d


def test_optimizer_and_scheduler_params_are_filled_and_checked():
    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": "lion", "params": {"lr": 1e-4}},
                       "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000}}}, dp_size=1)
    assert cfg.optimizer.type == "Lion" and cfg.optimizer.params == {"lr": 1e-4, "betas": (0.9, 0.99),
                                                                      "weight_decay": 0.0}
    assert cfg.scheduler.params["cos_min_ratio"] == 0.0001 and cfg.scheduler.params["warmup_num_steps"] == 1000
    with pytest.raises(ConfigError, match="scheduler type 'WarmupDecayLR' needs params.total_num_steps"):
        load_config({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {}}}, dp_size=1)
    with pytest.raises(ConfigError, match="'AdamW' with params.adam_w_mode false"):
        load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}},
                    dp_size=1)


def test_non_json_values_in_a_dict_are_rejected():
    with pytest.raises(ConfigError, match="only JSON values"):
        load_config({"train_batch_size": 8, "seed": object()})


def test_bad_json_file_names_the_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{\"train_batch_size\": 8,}")
    with pytest.raises(ConfigError, match="ds.json is not valid JSON"):
        load_config(path)


@pytest.mark.parametrize("raw, key", [
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}}}, "'amsgrad'"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}}, "'max_grad_norm'"),
    ({"sequence_parallel_size": 4}, "'sequence_parallel_size'"),
    ({"zero_optimization": {"stage": 1, "legacy_stage1": True}}, "'legacy_stage1'"),
])
def test_keys_that_change_training_are_refused_when_on_and_accepted_off(raw, key):
    with pytest.raises(UnsupportedConfigError, match=key):
        load_config({"train_batch_size": 8, **raw}, dp_size=1)
    off = {"amsgrad": False, "max_grad_norm": 0.0, "sequence_parallel_size": 1, "legacy_stage1": False}
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
