"""ZeRO-Offload (plait.zero.offload) through the engine on CPU/gloo: the offloaded run equals the
non-offloaded one bit for bit, at dp 1 and 2, ZeRO stages 1-3 (stage 3 also with offload_param),
gradient clipping active (deferred host steps) and off (early host steps during backward), GAS 2, bf16
host gradients and the device-assisted step; fp16 overflow on one rank skips the step everywhere;
checkpoints cross offload on/off. The reference steps with the same CPU kernel without offloading (see
``reference``), so equality holds by construction on every CPU and ISA (run with
``ATEN_CPU_CAPABILITY=avx2`` or ``default`` as CI does); a one-ulp change of the clip coefficient fails it.
The kernels' own agreement with torch's optimizers is tests/test_kernels.py's (per step, to 1e-6). The host
step overlaps the next forward (``overlap_step``): with the host optimizer slowed down, a forward and a
checkpoint save issued right after ``step()`` see exactly the updated weights, and the per-segment path is
the one taken (tests/test_offload_zero_optimizer.py). The run, its reference and the cases are
tests/offload_helpers.py's."""

import functools
import itertools
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from plait.testing import run_distributed
from helpers import rel_err
from offload_helpers import CASES, STEPS, ds_config, reference, slow_host_steps, train


def _body(ckpt_dir):
    rank = dist.get_rank()
    out = {}
    for name, (ref_cfg, off_cfg) in CASES.items():
        host_step = (
            "offload_optimizer" in off_cfg["zero_optimization"]
        )  # else torch's AdamW on both sides
        out[name] = ((reference if host_step else train)(ref_cfg, STEPS), train(off_cfg, STEPS))
    # device-assisted host step vs the all-CPU host step, 5 steps: bit-identical (same updates, and at
    # GAS 1 the norm is taken on the device for every segment whichever side steps it)
    for bf16 in (False, True):
        out[f"device step bitwise bf16={bf16}"] = (
            train(ds_config(2, offload=True, gas=1, bf16=bf16), STEPS),
            train(ds_config(2, offload=True, gas=1, bf16=bf16, device_step=0.5), STEPS),
        )
    # adaptive split: the CPU share is slowed down, so the device share grows at every step
    with slow_host_steps(0.01):
        adaptive = ds_config(2, offload=True, gas=1, device_step="auto")
        out["device step adaptive"] = (
            train(ds_config(2, offload=True, gas=1), STEPS),
            train(adaptive, STEPS),
        )
    # fp16: rank 1 (or rank 0 at dp 1) overflows on step 1; the step is skipped everywhere
    bad = dist.get_world_size() - 1
    poison = functools.partial(_poison, bad)
    out["fp16 overflow"] = (
        reference(ds_config(2, fp16=True), 4, poison=poison),
        train(ds_config(2, offload=True, fp16=True), 4, poison=poison),
    )
    # checkpoints across offload on/off: 3 steps, save, load into the other mode, 2 more steps
    for tag, first, second in (("on->off", True, False), ("off->on", False, True)):
        path = os.path.join(ckpt_dir, tag.replace(">", ""))
        (train if first else reference)(ds_config(2, offload=first), 3, save=path)
        out[f"checkpoint {tag}"] = (
            reference(ds_config(2), STEPS),
            (train if second else reference)(ds_config(2, offload=second), 2, start=3, load=path),
        )
    # the overlapped step read mid-flight: slow host steps; forward right after step() (the loop) and
    # save_checkpoint right after the last step(); the checkpoint loads into a non-offloaded engine
    with slow_host_steps(0.003):
        for tag, stage, param in (("stage2", 2, False), ("stage3+param", 3, True)):
            path = os.path.join(ckpt_dir, f"slow-{stage}")
            got = train(ds_config(stage, offload=True, param=param), 3, save=path)
            loaded = reference(ds_config(stage), 0, load=path)
            out[f"mid-flight {tag}"] = (reference(ds_config(stage), 3), got, loaded)
    return out if rank == 0 else None


def _poison(bad_rank, step, rank):
    return step == 1 and rank == bad_rank


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def results(request):
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(_body, request.param, tmp, timeout_s=300)[0]


def _assert_identical(ref, got, what=("weights", "masters")):
    """Bit for bit (see ``reference``): any difference is a fault of the offload path, not rounding."""
    for part in what:
        assert got[part].keys() == ref[part].keys(), part
        for key, want in ref[part].items():
            assert torch.equal(got[part][key], want), (
                f"{part} {key} off by {rel_err(got[part][key], want, floor=1e-12):.2e}"
            )


@pytest.mark.parametrize("case", list(CASES))
def test_offload_matches_device_optimizer(results, case):
    ref, got = results[case]
    assert got["steps"] == ref["steps"] == STEPS and got["lr"] == ref["lr"]
    assert got["losses"] == ref["losses"], case
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-15)  # float64 sums in another order
    # a placement gives the resident parameters flat groups of their own, so at dp 2 each rank's slices start
    # elsewhere: there the whole weights are compared (and the masters at dp 1, where every slice is whole)
    _assert_identical(
        ref, got, ("weights",) if "ratio" in case and got["dp"] > 1 else ("weights", "masters")
    )
    assert got["grad_dtype"] == (torch.bfloat16 if case.startswith("bf16") else torch.float32)
    assert (got["device_stepped"] > 0) == ("device step" in case or "ratio" in case)


@pytest.mark.parametrize("bf16", [False, True])
def test_device_step_is_bit_identical_to_cpu_step(results, bf16):
    """plait.zero.offload.device_share computes the CPU kernel's formula with the same roundings."""
    cpu, dev = results[f"device step bitwise bf16={bf16}"]
    assert dev["device_stepped"] > 0 and cpu["device_stepped"] == 0
    for key, m in cpu["masters"].items():
        assert torch.equal(dev["masters"][key].view(torch.int32), m.view(torch.int32)), key
    for name, w in cpu["weights"].items():
        assert torch.equal(dev["weights"][name], w), name


def test_adaptive_split_moves_work_to_the_idle_side_and_changes_no_bit(results):
    cpu, adaptive = results["device step adaptive"]
    history = adaptive["split_history"]  # segments on the device, per step (starts at 0)
    assert (
        history[0] == 0 and history[-1] >= 3 and all(b > a for a, b in itertools.pairwise(history))
    )
    for key, m in cpu["masters"].items():
        assert torch.equal(adaptive["masters"][key].view(torch.int32), m.view(torch.int32)), key


def test_fp16_overflow_on_one_rank_skips_the_offloaded_step(results):
    ref, got = results["fp16 overflow"]
    assert (
        got["skipped"] == ref["skipped"] == 1 and got["steps"] == ref["steps"] == 4
    )  # DeepSpeed counts the skip
    finite = [x for x in ref["losses"] if math.isfinite(x)]
    assert [x for x in got["losses"] if math.isfinite(x)] == finite
    _assert_identical(ref, got)


@pytest.mark.parametrize("tag", ["on->off", "off->on"])
def test_checkpoint_crosses_offload_on_and_off(results, tag):
    ref, got = results[f"checkpoint {tag}"]
    assert got["steps"] == ref["steps"] == STEPS
    assert got["losses"] == ref["losses"][3:]
    _assert_identical(ref, got)


@pytest.mark.parametrize("tag", ["stage2", "stage3+param"])
def test_forward_and_checkpoint_right_after_an_overlapped_step(results, tag):
    ref, got, loaded = results[f"mid-flight {tag}"]
    assert got["overlap"]["steps"] == 3 and got["overlap"]["segments_in_flight"] > 0
    assert got["overlap"]["waits"] > 3 * 2  # consumed piecewise by forward hooks, not all at once
    assert got["losses"] == ref["losses"]
    _assert_identical(ref, got)
    _assert_identical(ref, loaded, ("weights",))
