"""Real ds_config files from public projects (``tests/data/ds_configs``, sources in its SOURCES.md), read
unmodified: each trains as written on an unmodified Hugging Face Llama, its "auto" values filled the way the
Hugging Face Trainer fills them, or is refused naming a feature that changes training. Then, for every key
in the collection that changes the result, a test that its value is applied (a different value gives a
different run; the numbers that show it are the trained weights or the loss scale).

One process, CPU. The Trainer's side of a config: micro-batch 2, no accumulation, lr 1e-3, AdamW's
defaults, clip 1.0, bf16 where the config leaves the precision "auto", 2 warm-up steps of 6; with no
optimizer section the Trainer's own torch AdamW is passed in, as the Trainer does.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

import plait
from plait.config.unsupported import UnsupportedConfigError
from plait.testing import run_distributed
from plait.zero.precision import LossScaleError

CORPUS = Path(__file__).parent / "data" / "ds_configs"
STEPS = 4

#: file -> the feature its refusal names (each changes what a step computes and is not implemented)
REFUSED = {
    "deepspeed__deepspeed_bsz24_fp16_eigenvalue_quantize_config.json": "quantize_training",
    "dsexamples__autosp_config.json": "sequence_parallel_size",
    "dsexamples__bf16_full.json": "bf16_master_weights_and_grads",
    "dsexamples__deepspeed_bsz4k_progressive_layer_drop_config_seq128.json": "progressive_layer_drop",
    "dsexamples__deepspeed_bsz64k_onebitlamb_config_seq128_nccl.json": "OneBitLamb",
    "dsexamples__deepspeed_onebitadam_bsz96_config.json": "OnebitAdam",
    "dsexamples__ds_config_cifar_random_ltd.json": "data_efficiency",
    "dsexamples__ds_offload_nvme_aio.json": "nvme",
    "dsexamples__test.json": "quantize_training",
    "dsexamples__zf_config.json": "zenflow",
    "llama-factory__ds_z2_autotp_config.json": "autotp_size",
}
FILES = sorted(p.name for p in CORPUS.glob("*.json"))
TRAINS = [f for f in FILES if f not in REFUSED]

TRAINER_FACTS = dict(
    micro_batch_size=2,
    gradient_accumulation_steps=1,
    mixed_precision="bf16",
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    gradient_clipping=1.0,
    warmup_min_lr=0.0,
    warmup_num_steps=2,
    total_num_steps=6,
)


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )


def build(config, model=None, **facts):
    model = model if model is not None else llama()
    optimizer = None if config.get("optimizer") else torch.optim.AdamW(model.parameters(), lr=1e-3)
    return plait.initialize(model, config, optimizer=optimizer, **{**TRAINER_FACTS, **facts})


def run(engine, steps=STEPS):
    """Train ``steps`` optimizer steps on fixed batches; the micro-batch losses."""
    losses = []
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(steps):
        for j in range(engine.gradient_accumulation_steps()):
            g = torch.Generator().manual_seed(1000 * step + j)
            ids = torch.randint(0, 128, (micro, 9), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def weights(engine):
    with engine.gathered_parameters():
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def test_the_collection_is_large_and_every_file_has_a_source():
    sources = (CORPUS / "SOURCES.md").read_text()
    assert len(FILES) >= 20 and all(f in sources for f in FILES)
    assert len(TRAINS) >= 30


#: configs with a "compile" section: their decoder layers are compiled with inductor
COMPILES = {
    "deepspeed__ds_config_z3_deepcompile_no_persist.json",
    "axolotl__zero1_torch_compile.json",
}
INDUCTOR_AVX2 = pytest.mark.xfail(
    os.environ.get("ATEN_CPU_CAPABILITY") == "avx2",
    strict=False,
    reason="torch 2.13's inductor CPU code gives non-finite attention gradients under "
    "ATEN_CPU_CAPABILITY=avx2 (eager is finite); see tests/test_compile.py",
)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=INDUCTOR_AVX2) if n in COMPILES else n for n in TRAINS]
)
def test_a_real_config_trains_as_written(name, capsys):
    config = json.loads((CORPUS / name).read_text())
    before = {n: p.detach().float().clone() for n, p in llama().named_parameters()}
    engine = build(config)
    losses = run(engine)
    after = weights(engine)
    assert (
        engine.global_steps == STEPS and engine.skipped_steps < STEPS
    )  # counted as DeepSpeed counts them
    assert (
        engine.is_compiled is engine.config.compile.on
    )  # "compile" sections compile the decoder layers
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.isfinite(w).all() for w in after.values())
    assert (
        max((after[n] - before[n]).abs().max().item() for n in before) > 0
    )  # an update was applied


@pytest.mark.parametrize("name, feature", sorted(REFUSED.items()))
def test_a_real_config_is_refused_naming_a_feature_that_changes_training(name, feature):
    config = json.loads((CORPUS / name).read_text())
    with pytest.raises(UnsupportedConfigError) as err:
        build(config)
    assert feature in str(err.value) and "plait does not implement" in str(err.value)


# ---- every key of the collection that changes the result is applied ------------------------------------
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    },
    "zero_optimization": {"stage": 2},
}


def with_key(path, value, base=BASE):
    config = json.loads(json.dumps(base))
    node = config
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return config


def trained(config):
    engine = build(config)
    run(engine, 6)
    return weights(engine)


def max_change(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


WARMUP = {
    "type": "WarmupDecayLR",
    "params": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 1e-2,
        "warmup_num_steps": 2,
        "total_num_steps": 6,
        "warmup_type": "log",
    },
}
ADAM_L2 = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": True}}
LAMB = {
    "type": "LAMB",
    "params": {"lr": 1e-2, "weight_decay": 0.1, "max_coeff": 10.0, "min_coeff": 0.01},
}


@pytest.mark.parametrize(
    "path, a, b, base",
    [
        ("optimizer.params.lr", 1e-2, 1e-3, BASE),
        ("optimizer.params.betas", [0.9, 0.999], [0.5, 0.9], BASE),
        ("optimizer.params.eps", 1e-8, 1e-1, BASE),
        ("optimizer.params.weight_decay", 0.0, 0.5, BASE),
        ("optimizer.params.adam_w_mode", True, False, {**BASE, "optimizer": ADAM_L2}),
        ("optimizer.params.max_coeff", 10.0, 0.05, {**BASE, "optimizer": LAMB}),
        ("optimizer.params.min_coeff", 0.01, 5.0, {**BASE, "optimizer": LAMB}),
        (
            "optimizer.type",
            "AdamW",
            "SGD",
            {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}},
        ),
        ("gradient_clipping", 0.0, 0.01, BASE),
        ("gradient_accumulation_steps", 1, 2, BASE),
        ("train_micro_batch_size_per_gpu", 2, 1, BASE),
        ("bf16.enabled", False, True, BASE),
        ("fp16.enabled", False, True, BASE),
        ("scheduler", None, WARMUP, BASE),
        ("scheduler.params.warmup_num_steps", 2, 4, {**BASE, "scheduler": WARMUP}),
        ("scheduler.params.warmup_max_lr", 1e-2, 1e-3, {**BASE, "scheduler": WARMUP}),
        ("scheduler.params.warmup_min_lr", 0.0, 5e-3, {**BASE, "scheduler": WARMUP}),
        ("scheduler.params.warmup_type", "log", "linear", {**BASE, "scheduler": WARMUP}),
        ("scheduler.params.total_num_steps", 6, 3, {**BASE, "scheduler": WARMUP}),
        (
            "zero_optimization.stage",
            1,
            2,
            BASE,
        ),  # a control: the stage changes where state lives, not a bit
    ],
)
def test_a_results_changing_key_is_applied(path, a, b, base):
    change = max_change(trained(with_key(path, a, base)), trained(with_key(path, b, base)))
    if path == "zero_optimization.stage":
        assert change == 0.0
    else:
        assert change > 1e-5, f"{path}: {a!r} and {b!r} trained the same weights"


def test_bfloat16_is_bf16():
    """Megatron-DeepSpeed's configs spell the section ``bfloat16``: the same run as ``bf16``."""
    assert (
        max_change(
            trained({**BASE, "bfloat16": {"enabled": True}}),
            trained({**BASE, "bf16": {"enabled": True}}),
        )
        == 0
    )


def scale_trajectory(fp16, steps=6):
    """log2 of the loss scale after each step (the tiny model's fp16 gradients overflow above ~2^17)."""
    engine = build({**BASE, "fp16": fp16})
    out = []
    for _ in range(steps):
        run(engine, 1)
        out.append(int(engine.loss_scale).bit_length() - 1)
    return out


FP16 = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 1}


@pytest.mark.parametrize(
    "key, value",
    [
        ("initial_scale_power", 8),
        ("loss_scale", 128.0),
        ("hysteresis", 2),
        ("loss_scale_window", 1000),
    ],
)
def test_an_fp16_loss_scale_key_is_applied(key, value):
    assert scale_trajectory(FP16) != scale_trajectory({**FP16, key: value}), (
        f"fp16.{key} changed nothing"
    )


def test_fp16_min_loss_scale_is_applied():
    """From 2^24 the scale halves on every overflow down to ~2^18; a floor of 2^21 stops it there, where the
    gradients still overflow, and plait ends the run naming the floor (DeepSpeed's behaviour at the floor)."""
    start = {**FP16, "initial_scale_power": 24, "loss_scale_window": 1000}
    assert scale_trajectory(start)[-1] < 21
    with pytest.raises(LossScaleError, match="min_loss_scale"):
        scale_trajectory({**start, "min_loss_scale": 2**21})


def _reduce_body(comm_dtype):
    import torch.distributed as dist

    config = {**BASE, "communication_data_type": comm_dtype} if comm_dtype else BASE
    engine = build(config)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(3):
        ids = torch.randint(
            0, 128, (micro, 9), generator=torch.Generator().manual_seed(step * 10 + dist.get_rank())
        )
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return weights(engine)


def test_communication_data_type_is_applied():
    """At dp=2 the gradients are averaged in bf16 instead of fp32, so the weights differ (Adam turns the
    rounding of a small gradient into an update of up to ~lr, hence no tighter bound than 'not equal')."""
    fp32, bf16 = (run_distributed(_reduce_body, 2, t)[0] for t in (None, "bf16"))
    assert max_change(fp32, bf16) > 0
