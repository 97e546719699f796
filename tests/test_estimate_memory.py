"""``plait estimate-memory`` for a model (plait.fit): CLI output for Llama-2 shapes, its flags, the refusal message,
and bad input (the plan against the recorded peaks: test_estimate_memory_plan.py; against the engine:
test_estimate_memory_engine.py)."""

from __future__ import annotations

import json
import os
import re

import pytest

from plait.cli import main
from plait.fit import Settings, estimate, shape_from_hf
from plait.fit.check import refusal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
LLAMA2_7B = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    tie_word_embeddings=False,
)
LLAMA2_13B = dict(
    LLAMA2_7B,
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=40,
)


def write_config(folder, config) -> str:
    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def test_cli_plans_llama2_7b_from_config_json(tmp_path, capsys):
    write_config(tmp_path, LLAMA2_7B)
    assert (
        main(
            [
                "estimate-memory",
                str(tmp_path),
                "--gpu-gib",
                "139.8",
                "--host-gib",
                "125",
                "--micro",
                "4",
                "--act-ckpt",
                "--ratio",
                "0.2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "6,738,415,616 parameters (32 layers, hidden 4096, ffn 11008, 32/32 heads, vocab 32000)"
        in out
    )
    assert (
        "ZeRO-3, dp 1, offload_optimizer ratio 0.2, micro-batch 4 x 2048 tokens, activation checkpointing on"
        in out
    )
    # 25 blocks + the embedding resident (77.0% <= 80%): 5,190,631,424 elements x 14 B on the GPU
    assert "Adam moments (fp32)                              38.67     11.53" in out
    # host: 1,347,759,616 elements x 16 B + process and runtime (no copy-out buffer for the resident share)
    assert "bf16 copy-out buffer                              0.00      2.88" in out
    assert "resident share" not in out
    assert "peak                                             88.04     24.54" in out
    assert "fits: yes" in out
    assert "largest of these widths that fits: 50 layers, 10,381,316,096 parameters" in out


def test_cli_llama2_13b_that_does_not_fit_names_the_fixes(tmp_path, capsys):
    path = write_config(tmp_path, LLAMA2_13B)
    assert (
        main(
            [
                "estimate-memory",
                path,
                "--gpu-gib",
                "139.8",
                "--host-gib",
                "125",
                "--micro",
                "4",
                "--act-ckpt",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "13,015,864,320 parameters" in out
    assert "fits: no" in out
    assert "would fit with: zero_optimization.offload_optimizer with ratio 0.45 " in out


def test_refusal_names_bytes_on_each_side_and_the_fixes():
    shape = shape_from_hf(LLAMA2_13B)
    plan = estimate(
        shape,
        Settings(
            gpu_bytes=int(139.8 * GiB),
            host_bytes=125 * GiB,
            micro_batch=4,
            seq_len=2048,
            checkpointing=True,
        ),
    )
    text = refusal(plan, margin=0.10)
    assert text.startswith(
        "config.json (13,015,864,320 parameters) does not fit the GPU: it needs "
    )
    assert f"{plan.gpu_need / GiB:.1f} GiB on the GPU (of 139.8 GiB)" in text
    assert f"{plan.host_peak / GiB:.1f} GiB on the host (of 125.0 GiB)" in text
    assert "zero_optimization.offload_optimizer with ratio" in text
    assert "PLAIT_MEMORY_CHECK=0" in text
    # within the margin: not refused
    assert (
        refusal(
            estimate(
                shape,
                Settings(
                    gpu_bytes=int(plan.gpu_need / 1.05),
                    host_bytes=125 * GiB,
                    micro_batch=4,
                    seq_len=2048,
                    checkpointing=True,
                ),
            ),
            margin=0.10,
        )
        is None
    )


def test_the_host_refuses_on_planned_states_never_on_the_process_terms():
    """ZeRO-3 with full offload of a 1.6B model (Llama-2-13B's widths, 4 layers): 16 B/param of states on the
    host. A host just above them is not refused (the process terms are left out of the refusal: not every recorded
    host peak is explained, results/estimate_memory.md); one well below them is, naming the host."""
    shape = shape_from_hf(LLAMA2_13B).with_layers(4)

    def plan(host_gib):
        return estimate(
            shape,
            Settings(
                gpu_bytes=int(139.8 * GiB),
                host_bytes=int(host_gib * GiB),
                micro_batch=1,
                seq_len=2048,
                checkpointing=True,
                offload_optimizer=True,
                offload_param=True,
            ),
        )

    states = plan(1000).host_states
    assert states == 16 * shape.params and plan(1000).host_peak > states
    assert refusal(plan(states / GiB * 1.01), margin=0.10) is None
    text = refusal(plan(states / GiB / 1.2), margin=0.10)
    assert "does not fit the host" in text


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not UTF-8 JSON|JSON"),
        (
            json.dumps(dict(LLAMA2_7B, hidden_size=10**9)),
            "more than 1e\\+15: not a model any machine trains",
        ),
        (json.dumps(dict(LLAMA2_7B, vocab_size=-5)), "vocab_size=-5: must be a whole number >= 1"),
        (
            json.dumps(dict(LLAMA2_7B, model_type="gpt2")),
            "model_type='gpt2': plait estimate-memory covers dense",
        ),
        (json.dumps([1, 2]), "must hold a JSON object"),
    ],
)
def test_bad_config_json_gets_a_clear_error(tmp_path, capsys, content, message):
    (tmp_path / "config.json").write_text(content)
    assert (
        main(
            [
                "estimate-memory",
                str(tmp_path / "config.json"),
                "--gpu-gib",
                "80",
                "--host-gib",
                "64",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("plait estimate-memory: ")
    assert re.search(message, err), err


def test_missing_file_unknown_preset_and_bad_sizes(tmp_path, capsys):
    assert main(["estimate-memory", str(tmp_path / "nothere.json"), "--gpu-gib", "80"]) == 2
    assert "no config.json at" in capsys.readouterr().err
    assert (
        main(["estimate-memory", str(tmp_path), "--gpu-gib", "80", "--host-gib", "64"]) == 2
    )  # folder, no file
    assert "no config.json at" in capsys.readouterr().err
    assert main(["estimate-memory", "llama-nope", "--gpu-gib", "80", "--host-gib", "64"]) == 2
    assert "unknown preset 'llama-nope'" in capsys.readouterr().err
    assert main(["estimate-memory", "llama-886m", "--gpu-gib", "-3", "--host-gib", "64"]) == 2
    assert "--gpu-gib -3.0 must be a number of GiB" in capsys.readouterr().err
    assert (
        main(
            ["estimate-memory", "llama-886m", "--gpu-gib", "80", "--host-gib", "64", "--micro", "0"]
        )
        == 2
    )
    assert "micro_batch=0 must be a whole number >= 1" in capsys.readouterr().err


def test_cli_reads_stage_and_offload_from_a_real_ds_config(tmp_path, capsys):
    write_config(tmp_path, LLAMA2_7B)
    ds = os.path.join(
        ROOT, "tests", "data", "ds_configs", "transformers__ds_config_zero3_bf16.json"
    )
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
                "--ds-config",
                ds,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # the Hugging Face test suite's ZeRO-3 config offloads optimizer and parameters: 16 B/param on the host
    assert (
        "run: ZeRO-3, dp 1, offload_optimizer ratio 1, offload_param, micro-batch 4 x 2048 tokens"
        in out
    )
    assert "weights (bf16)                                    0.00     12.55" in out
    # the host bounds it: 8,155,099,136 x 16 B + process and runtime = 123.0 GiB of 125 (40 layers: 126.0)
    assert "largest of these widths that fits: 39 layers, 8,155,099,136 parameters" in out


def test_cli_ratio_takes_auto_or_a_share_and_names_the_flag(tmp_path, capsys):
    write_config(tmp_path, LLAMA2_7B)
    for bad in ("1.5", "half"):
        with pytest.raises(SystemExit):
            main(["estimate-memory", str(tmp_path), "--gpu-gib", "80", "--ratio", bad])
        assert (
            f"argument --ratio: '{bad}' is not a host share: give a number in [0, 1] or auto"
            in capsys.readouterr().err
        )
    assert (
        main(
            [
                "estimate-memory",
                str(tmp_path),
                "--gpu-gib",
                "8",
                "--host-gib",
                "125",
                "--ratio",
                "auto",
                "--offload-param",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(
        'offload_optimizer.ratio "auto" -> 1 (offload_param keeps every optimizer state on the host)\n'
    )


def test_cli_model_build_counts_the_fp32_host_copy(tmp_path, capsys):
    """``--model-build fp32``: a model built from its config on the host (LlamaForCausalLM(config)) holds 4 B per
    parameter there until plait.initialize moves it (plait.fit.host); the default (from_pretrained) holds none.
    Llama-2-7B at ratio 0.2 (the first test's run): the copy, 6,738,415,616 x 4 B = 25.10 GiB, is above the host
    states (1,347,759,616 x 16 B = 20.08 GiB), so the host peak is the process and runtime (1.48) plus the copy."""
    write_config(tmp_path, LLAMA2_7B)
    run = [
        "estimate-memory",
        str(tmp_path),
        "--gpu-gib",
        "139.8",
        "--host-gib",
        "125",
        "--micro",
        "4",
        "--act-ckpt",
        "--ratio",
        "0.2",
    ]
    assert main(run) == 0
    default = capsys.readouterr().out
    assert main(run + ["--model-build", "fp32"]) == 0
    built = capsys.readouterr().out
    assert "model build copy (none, before the states)        0.00      0.00" in default
    assert "peak                                             88.04     24.54" in default
    assert "model build copy (fp32, before the states)        0.00     25.10" in built
    assert "peak                                             88.04     26.58" in built
    with pytest.raises(SystemExit):
        main(run + ["--model-build", "bf16"])
    assert "argument --model-build: invalid choice: 'bf16'" in capsys.readouterr().err
