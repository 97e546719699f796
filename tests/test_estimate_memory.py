"""``plait estimate-memory`` for a model (plait.fit): CLI output for Llama-2 shapes, the calibration against the
recorded peaks, the engine's refusal before allocation, and bad input."""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
from dataclasses import replace

import pytest

from plait.cli import main
from plait.config import ConfigError, load_config
from plait.fit import Settings, estimate, shape_from_hf
from plait.fit.check import fit_config, refusal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
LLAMA2_7B = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False)
LLAMA2_13B = dict(LLAMA2_7B, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                  num_key_value_heads=40)


def write_config(folder, config) -> str:
    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def test_cli_plans_llama2_7b_from_config_json(tmp_path, capsys):
    write_config(tmp_path, LLAMA2_7B)
    assert main(["estimate-memory", str(tmp_path), "--gpu-gib", "139.8", "--host-gib", "125", "--micro", "4",
                 "--act-ckpt", "--ratio", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616 parameters (32 layers, hidden 4096, ffn 11008, 32/32 heads, vocab 32000)" in out
    assert "ZeRO-3, dp 1, offload_optimizer ratio 0.2, micro-batch 4 x 2048 tokens, activation checkpointing on" in out
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
    assert main(["estimate-memory", path, "--gpu-gib", "139.8", "--host-gib", "125", "--micro", "4",
                 "--act-ckpt"]) == 0
    out = capsys.readouterr().out
    assert "13,015,864,320 parameters" in out
    assert "fits: no" in out
    assert "would fit with: zero_optimization.offload_optimizer with ratio 0.45 " in out


def _calibration():
    spec = importlib.util.spec_from_file_location("estimate_memory_table",
                                                  os.path.join(ROOT, "benchmarks", "estimate_memory_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def table():
    return _calibration()


def test_predicted_peaks_within_ten_percent_of_the_recorded_ones(table):
    rows = table.rows()
    assert len(rows) == len(table.RECORDS) + 9   # the Trainer's records and bench_offload's plait rows
    gpu = [r for r in rows if r["gpu"]]
    assert len(gpu) == 5
    for r in gpu:   # every GPU peak (torch.cuda.max_memory_allocated) of the Trainer's records
        assert abs(r["gpu_pred"] / r["gpu"] - 1) <= table.TOLERANCE, r
    host = [r for r in rows if r["host"]]
    assert len(host) == 13
    for r in host:   # every host peak (VmHWM) recorded of today's code, the Trainer's and bench_offload's
        assert abs(r["host_pred"] / r["host"] - 1) <= table.TOLERANCE, r
    z3 = next(r for r in rows if r["record"] == "hf_trainer_estimate_1xH200.jsonl plait-z3")
    assert z3["terms"]["model build copy"] == pytest.approx(4 * 1_100_048_384 / GiB)   # the fp32 build peaks


@pytest.mark.parametrize("term", _calibration().TERMS)
def test_each_host_term_is_needed_by_some_recorded_peak(table, term):
    """Leaving out any term of the host model (the process, the model build copy, each state row) takes some
    recorded host peak more than 10% off."""
    off = [r for r in table.rows(drop=term) if r["host"] and abs(r["host_pred"] / r["host"] - 1) > table.TOLERANCE]
    assert off, term


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
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2))
    opt = plait.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                   "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                   "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                           "ratio": 0.5}}}).optimizer
    plan = estimate(model_shape(model), Settings(gpu_bytes=2**40, host_bytes=2**40, stage=3, offload_optimizer=True,
                                                 ratio=0.5))
    rows = {name.split(" (")[0]: host for name, _, host in plan.rows}
    host = [not g.key.resident for g in opt.groups]
    kernels = opt.optimizer.kernels
    assert any(host) and not all(host)

    def nbytes(tensors, which=True):
        return sum(t.nbytes for t, h in zip(tensors, host) if h == which)
    assert rows["fp32 master weights"] == nbytes(opt.masters) > 0
    assert rows["gradient shard"] == nbytes(opt.grad_shards)
    assert rows["Adam moments"] == nbytes([kernels[m].exp_avg for m in opt.masters]) + \
        nbytes([kernels[m].exp_avg_sq for m in opt.masters])
    assert rows["bf16 copy-out buffer"] == nbytes(opt.stepper.writer.lowp)
    assert "bf16 copy-out buffer of the resident share" not in rows
    assert all(buf is None for buf, h in zip(opt.stepper.writer.lowp, host) if not h)


def test_refusal_names_bytes_on_each_side_and_the_fixes():
    shape = shape_from_hf(LLAMA2_13B)
    plan = estimate(shape, Settings(gpu_bytes=int(139.8 * GiB), host_bytes=125 * GiB, micro_batch=4, seq_len=2048,
                                    checkpointing=True))
    text = refusal(plan, margin=0.10)
    assert text.startswith("config.json (13,015,864,320 parameters) does not fit the GPU: it needs ")
    assert f"{plan.gpu_need / GiB:.1f} GiB on the GPU (of 139.8 GiB)" in text
    assert f"{plan.host_peak / GiB:.1f} GiB on the host (of 125.0 GiB)" in text
    assert "zero_optimization.offload_optimizer with ratio" in text
    assert "PLAIT_MEMORY_CHECK=0" in text
    # within the margin: not refused
    assert refusal(estimate(shape, Settings(gpu_bytes=int(plan.gpu_need / 1.05), host_bytes=125 * GiB,
                                            micro_batch=4, seq_len=2048, checkpointing=True)), margin=0.10) is None


def test_the_host_refuses_on_planned_states_never_on_the_process_terms():
    """ZeRO-3 with full offload of a 1.6B model (Llama-2-13B's widths, 4 layers): 16 B/param of states on the
    host. A host just above them is not refused (the process terms are left out of the refusal: not every recorded
    host peak is explained, results/estimate_memory.md); one well below them is, naming the host."""
    shape = shape_from_hf(LLAMA2_13B).with_layers(4)

    def plan(host_gib):
        return estimate(shape, Settings(gpu_bytes=int(139.8 * GiB), host_bytes=int(host_gib * GiB), micro_batch=1,
                                        seq_len=2048, checkpointing=True, offload_optimizer=True,
                                        offload_param=True))
    states = plan(1000).host_states
    assert states == 16 * shape.params and plan(1000).host_peak > states
    assert refusal(plan(states / GiB * 1.01), margin=0.10) is None
    text = refusal(plan(states / GiB / 1.2), margin=0.10)
    assert "does not fit the host" in text


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def _config(**check):
    return load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "bf16": {"enabled": True},
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3},
                        "memory_check": check}, dp_size=1)


def test_engine_refuses_before_allocating_on_a_simulated_gpu(tiny_llama, monkeypatch):
    import torch
    monkeypatch.delenv("PLAIT_MEMORY_CHECK", raising=False)
    config = _config(gpu_bytes=2**20, host_bytes=2**40, seq_len=64)   # a 1 MiB GPU
    with pytest.raises(ConfigError, match=r"does not fit the GPU: it needs .* GiB on the GPU \(of 0\.0 GiB\)"):
        fit_config(tiny_llama, config, torch.device("cpu"))
    fit_config(tiny_llama, _config(gpu_bytes=2**40, host_bytes=2**40, seq_len=64), torch.device("cpu"))   # fits
    fit_config(tiny_llama, _config(gpu_bytes=2**20, enabled=False), torch.device("cpu"))   # switched off
    monkeypatch.setenv("PLAIT_MEMORY_CHECK", "0")
    fit_config(tiny_llama, config, torch.device("cpu"))


def test_initialize_refuses_before_building_the_engine(tiny_llama, monkeypatch):
    import plait
    monkeypatch.delenv("PLAIT_MEMORY_CHECK", raising=False)
    before = [p.data_ptr() for p in tiny_llama.parameters()]
    with pytest.raises(ConfigError, match="Refused before allocating"):
        plait.initialize(tiny_llama, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                      "zero_optimization": {"stage": 3},
                                      "memory_check": {"gpu_bytes": 2**20, "seq_len": 64}})
    assert [p.data_ptr() for p in tiny_llama.parameters()] == before   # the model was not moved or partitioned


@pytest.mark.parametrize("content, message", [
    ("{not json", "not UTF-8 JSON|JSON"),
    (json.dumps(dict(LLAMA2_7B, hidden_size=10**9)), "more than 1e\\+15: not a model any machine trains"),
    (json.dumps(dict(LLAMA2_7B, vocab_size=-5)), "vocab_size=-5: must be a whole number >= 1"),
    (json.dumps(dict(LLAMA2_7B, model_type="gpt2")), "model_type='gpt2': plait estimate-memory covers dense"),
    (json.dumps([1, 2]), "must hold a JSON object"),
])
def test_bad_config_json_gets_a_clear_error(tmp_path, capsys, content, message):
    (tmp_path / "config.json").write_text(content)
    assert main(["estimate-memory", str(tmp_path / "config.json"), "--gpu-gib", "80", "--host-gib", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait estimate-memory: ")
    assert re.search(message, err), err


def test_missing_file_unknown_preset_and_bad_sizes(tmp_path, capsys):
    assert main(["estimate-memory", str(tmp_path / "nothere.json"), "--gpu-gib", "80"]) == 2
    assert "no config.json at" in capsys.readouterr().err
    assert main(["estimate-memory", str(tmp_path), "--gpu-gib", "80", "--host-gib", "64"]) == 2   # folder, no file
    assert "no config.json at" in capsys.readouterr().err
    assert main(["estimate-memory", "llama-nope", "--gpu-gib", "80", "--host-gib", "64"]) == 2
    assert "unknown preset 'llama-nope'" in capsys.readouterr().err
    assert main(["estimate-memory", "llama-886m", "--gpu-gib", "-3", "--host-gib", "64"]) == 2
    assert "--gpu-gib -3.0 must be a number of GiB" in capsys.readouterr().err
    assert main(["estimate-memory", "llama-886m", "--gpu-gib", "80", "--host-gib", "64", "--micro", "0"]) == 2
    assert "micro_batch=0 must be a whole number >= 1" in capsys.readouterr().err


def test_cli_reads_stage_and_offload_from_a_real_ds_config(tmp_path, capsys):
    write_config(tmp_path, LLAMA2_7B)
    ds = os.path.join(ROOT, "tests", "data", "ds_configs", "transformers__ds_config_zero3_bf16.json")
    assert main(["estimate-memory", str(tmp_path), "--gpu-gib", "80", "--host-gib", "125", "--micro", "4",
                 "--act-ckpt", "--ds-config", ds]) == 0
    out = capsys.readouterr().out
    # the Hugging Face test suite's ZeRO-3 config offloads optimizer and parameters: 16 B/param on the host
    assert "run: ZeRO-3, dp 1, offload_optimizer ratio 1, offload_param, micro-batch 4 x 2048 tokens" in out
    assert "weights (bf16)                                    0.00     12.55" in out
    # the host bounds it: 8,155,099,136 x 16 B + process and runtime = 123.0 GiB of 125 (40 layers: 126.0)
    assert "largest of these widths that fits: 39 layers, 8,155,099,136 parameters" in out


def test_an_auto_ratio_keeps_on_the_gpu_the_most_that_fits(tiny_llama, caplog):
    """``offload_optimizer.ratio: "auto"``: the engine places the smallest host share (steps of 0.05) whose planned
    GPU need fits the GPU (simulated here: the need at ratio 0.5 plus 1 byte), and says so once in the log."""
    import plait
    from plait.fit.check import model_shape, settings_from_config
    raw = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "auto"}},
           "memory_check": {"seq_len": 64, "host_bytes": 2**40}}
    settings = settings_from_config(load_config({**raw, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, dp_size=1), 2**40, 2**40, 64, False)
    need = {r: estimate(model_shape(tiny_llama), replace(settings, ratio=r)).gpu_need for r in (0.45, 0.5)}
    assert need[0.45] > need[0.5]                    # a step of 0.05 moves the need: the choice below is sharp
    raw["memory_check"]["gpu_bytes"] = need[0.5] + 1
    with caplog.at_level("WARNING", logger="plait"):
        engine = plait.initialize(copy.deepcopy(tiny_llama), raw)
    assert engine.optimizer.offload_options.ratio == 0.5
    assert [r.getMessage() for r in caplog.records if "ratio" in r.getMessage()] == [
        f'config: offload_optimizer.ratio "auto" -> 0.5 (planned GPU need {need[0.5] / GiB:.1f} of '
        f'{(need[0.5] + 1) / GiB:.1f} GiB at micro-batch 2 x 64 tokens)']


def test_an_auto_ratio_of_a_model_it_cannot_plan_puts_every_state_on_the_host(caplog):
    import torch
    from plait.fit.check import fit_config
    config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "auto"}},
                          "memory_check": {"gpu_bytes": 2**40}}, dp_size=1)
    with caplog.at_level("WARNING", logger="plait"):
        got = fit_config(torch.nn.Linear(4, 4), config, torch.device("cpu"))
    assert got.zero_optimization.offload_optimizer.ratio == 1.0
    assert 'ratio "auto" -> 1 (Linear is not a Llama-style model plait.fit plans)' in caplog.text


@pytest.mark.parametrize("extra, why", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "offload_param keeps"),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, "the Lion optimizer keeps"),
])
def test_an_auto_ratio_where_states_cannot_stay_on_the_gpu_is_one(tiny_llama, extra, why, caplog):
    import torch
    raw = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "memory_check": {"gpu_bytes": 2**40}}
    raw.update(extra)
    raw["zero_optimization"] = {"stage": 2, **extra.get("zero_optimization", {}),
                                "offload_optimizer": {"device": "cpu", "ratio": "auto"}}
    with caplog.at_level("WARNING", logger="plait"):
        got = fit_config(tiny_llama, load_config(raw, dp_size=1), torch.device("cpu"))
    assert got.zero_optimization.offload_optimizer.ratio == 1.0 and f'"auto" -> 1 ({why} every' in caplog.text


@pytest.mark.parametrize("offload", [True, False])
def test_lower_precision_moments_shrink_the_plan_by_their_bytes(offload):
    """``optimizer.params.state_dtype``: bf16 moments take 4 bytes per element of the partition instead of 8;
    int8 ones 2 plus a float32 scale per block of 256 for each moment (plait.kernels.quant)."""
    from plait.fit.plan import moment_bytes
    shape = shape_from_hf(LLAMA2_13B)
    base = Settings(gpu_bytes=int(139.8 * GiB), host_bytes=125 * GiB, micro_batch=1, seq_len=2048,
                    checkpointing=True, offload_optimizer=offload)

    def total(dtype):
        plan = estimate(shape, replace(base, state_dtype=dtype))
        return sum(r[1] + r[2] for r in plan.rows)
    n = shape.params
    assert total("fp32") - total("bf16") == 4 * n
    assert total("fp32") - total("int8") == 8 * n - (2 * n + 8 * -(-n // 256)) == 8 * n - moment_bytes(n, "int8")
    with pytest.raises(ValueError, match="state_dtype='int4'"):
        replace(base, state_dtype="int4")
