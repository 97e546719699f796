"""``plait.fit``'s plan against the recorded peaks (``benchmarks/estimate_memory_table.py``: every GPU and host peak
within 10%, each host term needed) and its optimizer-state rows by moment dtype."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest

from plait.fit import Settings, estimate, shape_from_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
LLAMA2_13B = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=40,
    tie_word_embeddings=False,
)


def _calibration():
    spec = importlib.util.spec_from_file_location(
        "estimate_memory_table", os.path.join(ROOT, "benchmarks", "estimate_memory_table.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def table():
    return _calibration()


def test_predicted_peaks_within_ten_percent_of_the_recorded_ones(table):
    rows = table.rows()
    assert (
        len(rows) == len(table.RECORDS) + 9
    )  # the Trainer's records and bench_offload's plait rows
    gpu = [r for r in rows if r["gpu"]]
    assert len(gpu) == 6
    for r in gpu:  # every GPU peak (torch.cuda.max_memory_allocated) of the Trainer's records
        assert abs(r["gpu_pred"] / r["gpu"] - 1) <= table.TOLERANCE, r
    host = [r for r in rows if r["host"]]
    assert len(host) == 14
    for r in (
        host
    ):  # every host peak (VmHWM) recorded of today's code, the Trainer's and bench_offload's
        assert abs(r["host_pred"] / r["host"] - 1) <= table.TOLERANCE, r
    z3 = next(r for r in rows if r["record"] == "hf_trainer_estimate_1xH200.jsonl plait-z3")
    assert z3["terms"]["model build copy"] == pytest.approx(
        4 * 1_100_048_384 / GiB
    )  # the fp32 build peaks


@pytest.mark.parametrize("term", _calibration().TERMS)
def test_each_host_term_is_needed_by_some_recorded_peak(table, term):
    """Leaving out any term of the host model (the process, the model build copy, each state row) takes some
    recorded host peak more than 10% off."""
    off = [
        r
        for r in table.rows(drop=term)
        if r["host"] and abs(r["host_pred"] / r["host"] - 1) > table.TOLERANCE
    ]
    assert off, term


@pytest.mark.parametrize("offload", [True, False])
def test_lower_precision_moments_shrink_the_plan_by_their_bytes(offload):
    """``optimizer.params.state_dtype``: bf16 moments take 4 bytes per element of the partition instead of 8;
    int8 ones 2 plus a float32 scale per block of 256 for each moment (plait.kernels.quant)."""
    from plait.fit.plan import moment_bytes

    shape = shape_from_hf(LLAMA2_13B)
    base = Settings(
        gpu_bytes=int(139.8 * GiB),
        host_bytes=125 * GiB,
        micro_batch=1,
        seq_len=2048,
        checkpointing=True,
        offload_optimizer=offload,
    )

    def total(dtype):  # the states (fp32 moments alone also stream a device share: the test below)
        plan = estimate(shape, replace(base, state_dtype=dtype))
        return sum(r[1] + r[2] for r in plan.rows if not r[0].startswith("device share"))

    n = shape.params
    assert total("fp32") - total("bf16") == 4 * n
    assert (
        total("fp32") - total("int8")
        == 8 * n - (2 * n + 8 * -(-n // 256))
        == 8 * n - moment_bytes(n, "int8")
    )
    with pytest.raises(ValueError, match="state_dtype='int4'"):
        replace(base, state_dtype="int4")


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_only_fp32_moments_stream_a_device_share_and_the_step_counts_its_range(state_dtype):
    """bench_offload's 20.68B Llama at ratio 0.5 (hf_trainer_int8_1xH200.jsonl): bf16/int8 moments have no
    streamed device share (HostStepper._streams_moments), so no streamed gradients on the GPU; the resident share
    is stepped one segment at a time, the largest being the embedding (32000 x 6144 = 196,608,000 elements: the
    MLP weights, 6144 x 16384, and the hidden^2 bucket are smaller), with STEP_BYTES_PER_ELEMENT per element
    after the activations are freed."""
    from plait.fit.plan import STEP_BYTES_PER_ELEMENT, largest_resident_segment

    shape = shape_from_hf(
        dict(
            LLAMA2_13B,
            hidden_size=6144,
            intermediate_size=16384,
            num_hidden_layers=52,
            num_attention_heads=48,
            num_key_value_heads=8,
        )
    )
    s = Settings(
        gpu_bytes=1 << 40,
        host_bytes=1 << 40,
        micro_batch=4,
        checkpointing=True,
        offload_optimizer=True,
        ratio=0.5,
        state_dtype=state_dtype,
        bucket_numel=6144 * 6144,
    )
    plan = estimate(shape, s)
    streamed = [r for r in plan.rows if r[0].startswith("device share")]
    assert len(streamed) == (state_dtype == "fp32")
    assert largest_resident_segment(shape, s) == 196_608_000
    assert plan.step == STEP_BYTES_PER_ELEMENT[state_dtype] * 196_608_000 < plan.activations
    assert plan.gpu_peak == sum(r[1] for r in plan.rows) + plan.activations
    assert (
        estimate(shape, replace(s, micro_batch=1)).gpu_peak
        == sum(r[1] for r in plan.rows) + plan.step
    )
