"""plait.zero.memory: model-state memory against the ZeRO and ZeRO-Offload papers' accounting."""

import pytest
import torch
from torch import nn

from plait.cli import main, parse_count
from plait.zero.memory import (
    GB,
    GiB,
    estimate_all_stages,
    estimate_for_model,
    estimate_model_state_memory,
    format_memory_table,
)

PSI, N = 7_500_000_000, 64  # the ZeRO paper's Fig. 1 example: 7.5B parameters on 64 GPUs


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, gb):
    e = estimate_model_state_memory(PSI, N, stage)
    assert round(e.gpu.total / GB, 1) == gb
    assert e.cpu.total == 0


def test_exact_bytes_follow_the_formulas():
    part = PSI // N  # 117,187,500 elements per rank
    s0, s1, s2, s3 = (estimate_model_state_memory(PSI, N, s).gpu for s in range(4))
    assert (s0.params, s0.grads, s0.optimizer_states) == (2 * PSI, 2 * PSI, 12 * PSI)
    assert (s1.params, s1.grads, s1.optimizer_states) == (2 * PSI, 2 * PSI, 12 * part)
    assert (s2.params, s2.grads, s2.optimizer_states) == (2 * PSI, 2 * part, 12 * part)
    assert (s3.params, s3.grads, s3.optimizer_states) == (2 * part, 2 * part, 12 * part)
    assert s3.total == 1_875_000_000


def test_partitions_round_up():
    e = estimate_model_state_memory(10, 4, 3)  # ceil(10 / 4) = 3 elements per rank
    assert (e.gpu.params, e.gpu.grads, e.gpu.optimizer_states) == (6, 6, 36)


def test_fp32_training_is_4_4_8():
    e0 = estimate_model_state_memory(1000, 4, 0, mixed_precision=False)
    assert (e0.gpu.params, e0.gpu.grads, e0.gpu.optimizer_states) == (4000, 4000, 8000)
    e3 = estimate_model_state_memory(1000, 4, 3, mixed_precision=False)
    assert e3.gpu.total == 16 * 250
    lion = estimate_model_state_memory(1000, 1, 0, optimizer_states=1)
    assert lion.gpu.optimizer_states == 8 * 1000  # fp32 master + one momentum


def test_offload_optimizer_zero2_matches_zero_offload_split():
    # ZeRO-Offload (Ren et al. 2021): GPU keeps fp16 params (2 bytes); host keeps the fp16 gradient partition
    # and 12 bytes of fp32 optimizer state per partitioned parameter, for each of the 8 ranks on a host.
    e = estimate_model_state_memory(PSI, N, 2, offload_optimizer=True, num_gpus_per_node=8)
    part = PSI // N
    assert (e.gpu.params, e.gpu.grads, e.gpu.optimizer_states) == (2 * PSI, 0, 0)
    assert (e.cpu.params, e.cpu.grads, e.cpu.optimizer_states) == (0, 8 * 2 * part, 8 * 12 * part)
    assert e.cpu.total == 8 * 14 * part
    single = estimate_model_state_memory(1_000_000, 1, 2, offload_optimizer=True)
    assert single.cpu.total == 14_000_000 and single.gpu.total == 2_000_000  # one rank on the host
    s1 = estimate_model_state_memory(1_000_000, 4, 1, offload_optimizer=True)
    assert s1.gpu.grads == 2_000_000  # stage 1 does not partition gradients on the GPU


def test_offload_param_zero3_moves_everything_to_host():
    e = estimate_model_state_memory(
        8_000_000, 8, 3, offload_optimizer=True, offload_param=True, num_gpus_per_node=8
    )
    assert e.gpu.total == 0
    assert (
        e.cpu.total == 16 * 8_000_000
    )  # the host holds all 8 ranks' partitions: 2 + 2 + 12 bytes each
    fp32 = estimate_model_state_memory(
        8_000_000, 8, 3, offload_optimizer=True, mixed_precision=False
    )
    assert fp32.cpu.optimizer_states == 8 * 12 * 1_000_000  # fp32 master copy on the host + m + v


def test_invalid_combinations_raise_with_the_fix():
    with pytest.raises(ValueError, match="offload_param needs ZeRO stage 3.*got stage 2"):
        estimate_model_state_memory(10, 2, 2, offload_param=True)
    with pytest.raises(ValueError, match="offload_optimizer needs ZeRO stage 1, 2 or 3"):
        estimate_model_state_memory(10, 2, 0, offload_optimizer=True)
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3, got 5"):
        estimate_model_state_memory(10, 2, 5)
    with pytest.raises(ValueError, match="dp_size must be an integer >= 1, got 0"):
        estimate_model_state_memory(10, 0, 1)


def test_estimate_for_model_counts_tied_parameters_once():
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight  # tied
    model = nn.Sequential(emb, nn.Linear(16, 16), head)
    n = 100 * 16 + 16 * 16 + 16
    e = estimate_for_model(model, dp_size=2, stage=1)
    assert e.num_params == n and e.gpu.total == 4 * n + 12 * (n // 2)
    e3 = estimate_for_model(
        model, dp_size=2, stage=3
    )  # + the largest module (1600 params) gathered
    assert e3.gpu.params == 2 * (n // 2) + 2 * 1600 and e3.gpu.grads == 2 * (n // 2) + 2 * 1600
    with torch.device("meta"):
        big = nn.Linear(4096, 4096)
    assert estimate_for_model(big, 8, 2).num_params == 4096 * 4096 + 4096


def test_all_stages_and_table():
    rows = estimate_all_stages(PSI, N, offload_optimizer=True, offload_param=True)
    assert [r.offload for r in rows] == ["-", "opt", "opt", "opt+param"]
    text = format_memory_table(estimate_all_stages(PSI, N), unit="GB")
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["stage", "offload"]
    assert [line.split()[-2] for line in lines[2:6]] == ["120.00", "31.41", "16.64", "1.88"]
    assert "111.76" in format_memory_table(estimate_all_stages(PSI, N))  # 120e9 bytes in GiB
    assert GiB == 1 << 30


def test_parse_count():
    assert parse_count("7e9") == parse_count("7B") == parse_count("7000000000") == 7 * 10**9
    assert parse_count("1.3b") == 1_300_000_000 and parse_count("350M") == 350_000_000


def test_cli_estimate_memory_prints_all_stages(capsys):
    assert (
        main(["estimate-memory", "--params", "7.5e9", "--dp", "64", "--stage", "3", "--unit", "GB"])
        == 0
    )
    out = capsys.readouterr().out
    assert "7,500,000,000 parameters, dp=64" in out
    rows = [line.split() for line in out.splitlines() if line[:1] in "0123" and line.strip()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [r[5] for r in rows] == ["120.00", "31.41", "16.64", "1.88"] and "<- --stage" in out
    assert (
        main(
            [
                "estimate-memory",
                "--params",
                "7e9",
                "--dp",
                "8",
                "--offload-optimizer",
                "--offload-param",
                "--gpus-per-node",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "opt+param" in out and "GiB" in out


def test_cli_check_config(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}')
    assert main(["check-config", str(path), "--dp", "4"]) == 0
    assert '"train_batch_size": 8' in capsys.readouterr().out
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 1}}')
    assert main(["check-config", str(path), "--dp", "4"]) == 2
    assert "did you mean 'zero_optimization'?" in capsys.readouterr().err


def test_cli_unknown_subcommand_exits_2():
    with pytest.raises(SystemExit) as err:
        main(["no-such-command"])
    assert err.value.code == 2
