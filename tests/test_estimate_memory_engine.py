"""``plait estimate-memory``'s plan against the engine (plait.fit): the host rows are the engine's host tensors, the
engine's refusal before allocation, and the "auto" offload ratio it resolves (one tiny Llama shared)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from plait.config import ConfigError, load_config
from plait.fit import Settings, estimate
from plait.fit.check import fit_config

GiB = 2**30


def test_the_host_rows_are_the_engines_host_tensors():
    """A tiny unmodified Llama under ZeRO-3 with half of the optimizer states on the host (ratio 0.5; on the CPU
    the resident share's tensors are host memory too, told apart by their group's key): the plan's host rows are
    the bytes of the engine's host masters, gradient shards, moments and copy-out buffers, and the resident share
    has no copy-out buffer (plait.zero.offload.copyback.CopyBack; it had one, never written, before)."""
    import plait
    import torch
    import transformers
    from plait.fit.check import model_shape

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    opt = plait.initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        },
    ).optimizer
    plan = estimate(
        model_shape(model),
        Settings(gpu_bytes=2**40, host_bytes=2**40, stage=3, offload_optimizer=True, ratio=0.5),
    )
    rows = {name.split(" (")[0]: host for name, _, host in plan.rows}
    host = [not g.key.resident for g in opt.groups]
    kernels = opt.optimizer.kernels
    assert any(host) and not all(host)

    def nbytes(tensors, which=True):
        return sum(t.nbytes for t, h in zip(tensors, host) if h == which)

    assert rows["fp32 master weights"] == nbytes(opt.masters) > 0
    assert rows["gradient shard"] == nbytes(opt.grad_shards)
    assert rows["Adam moments"] == nbytes([kernels[m].exp_avg for m in opt.masters]) + nbytes(
        [kernels[m].exp_avg_sq for m in opt.masters]
    )
    assert rows["bf16 copy-out buffer"] == nbytes(opt.stepper.writer.lowp)
    assert "bf16 copy-out buffer of the resident share" not in rows
    assert all(buf is None for buf, h in zip(opt.stepper.writer.lowp, host) if not h)


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config)


def _config(**check):
    return load_config(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3},
            "memory_check": check,
        },
        dp_size=1,
    )


def test_engine_refuses_before_allocating_on_a_simulated_gpu(tiny_llama, monkeypatch):
    import torch

    monkeypatch.delenv("PLAIT_MEMORY_CHECK", raising=False)
    config = _config(gpu_bytes=2**20, host_bytes=2**40, seq_len=64)  # a 1 MiB GPU
    with pytest.raises(
        ConfigError, match=r"does not fit the GPU: it needs .* GiB on the GPU \(of 0\.0 GiB\)"
    ):
        fit_config(tiny_llama, config, torch.device("cpu"))
    fit_config(
        tiny_llama, _config(gpu_bytes=2**40, host_bytes=2**40, seq_len=64), torch.device("cpu")
    )  # fits
    fit_config(
        tiny_llama, _config(gpu_bytes=2**20, enabled=False), torch.device("cpu")
    )  # switched off
    monkeypatch.setenv("PLAIT_MEMORY_CHECK", "0")
    fit_config(tiny_llama, config, torch.device("cpu"))


def test_a_placement_the_plan_does_not_model_trains_unchecked(tiny_llama, monkeypatch):
    """ZeRO-3 with offload_param alone runs in the engine (tests/test_offload.py) but is not planned: on a GPU
    the check let the planner's ValueError stop ``initialize`` (tests/gpu/run_offload_gpu.py, 2026-11-29). The
    check now passes it over; a GPU is simulated with ``memory_check.gpu_bytes``."""
    import torch

    monkeypatch.delenv("PLAIT_MEMORY_CHECK", raising=False)
    config = _config(gpu_bytes=2**20, host_bytes=2**40, seq_len=64)  # a 1 MiB GPU: planned, refused
    z = replace(
        config.zero_optimization,
        offload_param=replace(config.zero_optimization.offload_param, device="cpu"),
    )
    config = replace(config, zero_optimization=z)
    assert config.zero_optimization.offload_param.enabled
    assert fit_config(tiny_llama, config, torch.device("cpu")) is config


def test_initialize_refuses_before_building_the_engine(tiny_llama, monkeypatch):
    import plait

    monkeypatch.delenv("PLAIT_MEMORY_CHECK", raising=False)
    before = [p.data_ptr() for p in tiny_llama.parameters()]
    with pytest.raises(ConfigError, match="Refused before allocating"):
        plait.initialize(
            tiny_llama,
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3},
                "memory_check": {"gpu_bytes": 2**20, "seq_len": 64},
            },
        )
    assert [
        p.data_ptr() for p in tiny_llama.parameters()
    ] == before  # the model was not moved or partitioned


def test_an_auto_ratio_keeps_on_the_gpu_the_most_that_fits(tiny_llama, caplog):
    """``offload_optimizer.ratio: "auto"``: the engine places the smallest host share (steps of 0.05) whose planned
    GPU need fits the GPU (simulated here: the need at ratio 0.5 plus 1 byte), and says so once in the log."""
    import plait
    from plait.fit.check import model_shape, settings_from_config

    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "auto"}},
        "memory_check": {"seq_len": 64, "host_bytes": 2**40},
    }
    settings = settings_from_config(
        load_config(
            {
                **raw,
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                },
            },
            dp_size=1,
        ),
        2**40,
        2**40,
        64,
        False,
    )
    need = {
        r: estimate(model_shape(tiny_llama), replace(settings, ratio=r)).gpu_need
        for r in (0.45, 0.5)
    }
    assert need[0.45] > need[0.5]  # a step of 0.05 moves the need: the choice below is sharp
    raw["memory_check"]["gpu_bytes"] = need[0.5] + 1
    with caplog.at_level("WARNING", logger="plait"):
        engine = plait.initialize(copy.deepcopy(tiny_llama), raw)
    assert engine.optimizer.offload_options.ratio == 0.5
    assert [r.getMessage() for r in caplog.records if "ratio" in r.getMessage()] == [
        f'config: offload_optimizer.ratio "auto" -> 0.5 (planned GPU need {need[0.5] / GiB:.1f} of '
        f"{(need[0.5] + 1) / GiB:.1f} GiB at micro-batch 2 x 64 tokens)"
    ]


def test_an_auto_ratio_of_a_model_it_cannot_plan_puts_every_state_on_the_host(caplog):
    import torch
    from plait.fit.check import fit_config

    config = load_config(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "ratio": "auto"},
            },
            "memory_check": {"gpu_bytes": 2**40},
        },
        dp_size=1,
    )
    with caplog.at_level("WARNING", logger="plait"):
        got = fit_config(torch.nn.Linear(4, 4), config, torch.device("cpu"))
    assert got.zero_optimization.offload_optimizer.ratio == 1.0
    assert 'ratio "auto" -> 1 (Linear is not a Llama-style model plait.fit plans)' in caplog.text


@pytest.mark.parametrize(
    "extra, why",
    [
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
            "offload_param keeps",
        ),
        ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, "the Lion optimizer keeps"),
    ],
)
def test_an_auto_ratio_where_states_cannot_stay_on_the_gpu_is_one(tiny_llama, extra, why, caplog):
    import torch

    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "memory_check": {"gpu_bytes": 2**40},
    }
    raw.update(extra)
    raw["zero_optimization"] = {
        "stage": 2,
        **extra.get("zero_optimization", {}),
        "offload_optimizer": {"device": "cpu", "ratio": "auto"},
    }
    with caplog.at_level("WARNING", logger="plait"):
        got = fit_config(tiny_llama, load_config(raw, dp_size=1), torch.device("cpu"))
    assert (
        got.zero_optimization.offload_optimizer.ratio == 1.0
        and f'"auto" -> 1 ({why} every' in caplog.text
    )


def test_cli_ratio_auto_says_the_ratio_the_engine_picks(tmp_path, capsys, caplog):
    """``plait estimate-memory --ratio auto`` prints the host share the engine's "auto" resolves to
    (plait.fit.check.fit_config) for the same model and run: Llama-2-7B (built on the meta device: nothing is
    allocated) on an 80 GiB GPU, micro-batch 4 x 2048, checkpointing, ZeRO-3 with pin_memory (the streamed
    device share on, as the CLI plans it). The ratio is 0.35, and the same line is said by both."""
    import torch
    import transformers
    from plait.cli import main

    hf = dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    )
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert (
        main(
            [
                "estimate-memory",
                str(tmp_path),
                "--gpu-gib",
                "80",
                "--host-gib",
                "125",
                "--micro",
                "4",
                "--act-ckpt",
                "--ratio",
                "auto",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
    # transformers 5 renamed it (the old name warns); 4.56, the lowest admitted, has only the old one
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    config = load_config(
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "ratio": "auto", "pin_memory": True},
            },
            "memory_check": {"gpu_bytes": 80 * GiB, "host_bytes": 125 * GiB, "seq_len": 2048},
        },
        dp_size=1,
    )
    with caplog.at_level("WARNING", logger="plait"):
        got = fit_config(model, config, torch.device("cpu"))
    assert got.zero_optimization.offload_optimizer.ratio == 0.35
    said = [r.getMessage() for r in caplog.records if "auto" in r.getMessage()]
    assert said == ["config: " + out.splitlines()[0]]
    assert out.startswith(
        'offload_optimizer.ratio "auto" -> 0.35 (planned GPU need 79.5 of 80.0 GiB at '
    )
    assert "run: ZeRO-3, dp 1, offload_optimizer ratio 0.35, micro-batch 4 x 2048 tokens" in out
