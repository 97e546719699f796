"""Adam moments in bf16 / 8-bit blocks through the engine (``optimizer.params.state_dtype``): offloaded ZeRO-2
(the numba kernels) and non-offloaded ZeRO-2 (the same kernels over the device masters) step bit for bit alike,
the loss falls as with fp32 moments, checkpoints resume in another placement exactly and into another state
dtype by name, the state bytes per parameter, and the refusals. The kernels' error bounds are
tests/test_quant_states.py's."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch

import plait
from plait.config import ConfigError
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.testing import run_distributed
from helpers import micro_batch, tiny
from offload_helpers import ds_config, whole

STEPS, SAVE_AT = 12, 6


def config(state_dtype, offload, ratio=1.0, **extra):
    cfg = ds_config(2, offload=offload, gas=1, ratio=ratio)
    cfg["optimizer"]["params"].update(state_dtype=state_dtype, **extra)
    cfg["scheduler"]["params"]["warmup_max_lr"] = 1e-2
    return cfg


def run(cfg, steps, start=0, load=None, save=None):
    """``steps`` optimizer steps on one fixed batch (the loss falls as the model memorizes it)."""
    mesh = ParallelMesh()
    engine = plait.initialize(TransformerModel(tiny(), mesh, seed=5), cfg, mesh=mesh)
    if load:
        engine.load_checkpoint(load)
    batch, losses = micro_batch(0, 0, 0), []
    for _ in range(start, start + steps):
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    if save:
        engine.save_checkpoint(save)
    opt = engine.optimizer
    out = {
        "losses": losses,
        "weights": whole(engine),
        "slices": {
            (s.name, s.start): {k: v.clone() for k, v in s.state.items()}
            for s in opt.shard_state().slices
        },
        "bytes": opt.memory_bytes()["optimizer_state"],
        "numel": sum(m.numel() for m in opt.masters),
        "optimizer": type(opt.optimizer).__name__,
    }
    opt.close()
    return out


@pytest.fixture(scope="module")
def runs():
    return {
        (sd, off): run(config(sd, off), STEPS)
        for sd in ("fp32", "bf16", "int8")
        for off in (False, True)
        if sd != "fp32" or off
    }


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_offloaded_and_not_step_alike_and_the_loss_falls_as_with_fp32_moments(runs, state_dtype):
    """Both placements run the same kernels on the CPU: equal bit for bit. The loss falls (memorizing one batch,
    5.56 -> 2.70 with fp32 moments) and ends close to the fp32 run's: bf16 moments (within 2^-8 of each value)
    within 0.1% (measured 0.003%); int8 within 2% (measured 1.1%: an element whose second moment is small
    beside its block's absmax reads back with a coarse relative error, and its update with it; the 0.7% of
    absmax per step bound is tests/test_quant_states.py's)."""
    on, off = runs[(state_dtype, True)], runs[(state_dtype, False)]
    assert on["losses"] == off["losses"]
    for name, w in off["weights"].items():
        assert torch.equal(on["weights"][name], w), name
    ref = runs[("fp32", True)]["losses"]
    assert (
        off["optimizer"] == "HostOptimizer"
    )  # the kernels over the device masters (torch ops on a GPU)
    assert off["losses"][-1] < 0.8 * off["losses"][0]
    tolerance = {"bf16": 0.001, "int8": 0.02}[state_dtype]
    assert abs(off["losses"][-1] - ref[-1]) <= tolerance * ref[-1], (off["losses"], ref)
    assert off["losses"] != ref  # the stored precision does change the run


def test_state_bytes_per_parameter(runs):
    per = {
        sd: runs[(sd, True)]["bytes"] / runs[(sd, True)]["numel"] for sd in ("fp32", "bf16", "int8")
    }
    assert 8.0 <= per["fp32"] < 8.01 and 4.0 <= per["bf16"] < 4.01
    assert (
        2.0 + 8 / 256 <= per["int8"] < 2.0 + 8 / 256 + 0.02
    )  # + the blocks cut short at parameter ends


@pytest.mark.parametrize("second", [dict(offload=False), dict(offload=True, ratio=0.5)])
def test_an_int8_checkpoint_resumes_in_another_placement_exactly(runs, second, tmp_path):
    """Saved offloaded (ratio 1) after 6 steps, resumed non-offloaded or half on the device: blocks start at
    every parameter piece, so the requantized moments are the saved ones and the run continues bit for bit."""
    whole = runs[("int8", True)]
    run(config("int8", True), SAVE_AT, save=str(tmp_path / "ckpt"))
    resumed = run(
        config("int8", **second), STEPS - SAVE_AT, start=SAVE_AT, load=str(tmp_path / "ckpt")
    )
    assert resumed["losses"] == whole["losses"][SAVE_AT:]
    for name, w in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


def test_int8_states_load_into_an_fp32_run_by_name(tmp_path, caplog):
    saved = run(config("int8", True), SAVE_AT, save=str(tmp_path / "ckpt"))
    with caplog.at_level(logging.WARNING, logger="plait"):
        loaded = run(config("fp32", True), 0, start=SAVE_AT, load=str(tmp_path / "ckpt"))
    assert "saved as int8 are loaded by name into state_dtype fp32" in caplog.text
    assert loaded["slices"].keys() == saved["slices"].keys()
    for key, st in saved["slices"].items():  # the dequantized int8 values, now fp32 moments
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["slices"][key][name], st[name]), (key, name)


def test_a_state_dtype_plait_cannot_serve_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="state_dtype"):
        run(config("int4", False), 1)
    lion = config("fp32", True)
    lion["optimizer"] = {"type": "Lion", "params": {"lr": 1e-4, "state_dtype": "int8"}}
    with pytest.raises(ConfigError, match="state_dtype"):
        run(lion, 1)
    mesh = ParallelMesh()
    with pytest.raises(
        ConfigError,
        match=r"optimizer.params.state_dtype = 'int8' applies to the config's Adam/AdamW",
    ):
        plait.initialize(
            TransformerModel(tiny(), mesh, seed=5),
            config("int8", False),
            mesh=mesh,
            optimizer=torch.optim.AdamW,
        )
    cfg = config("int8", True)
    cfg["zero_optimization"]["offload_optimizer"]["device_step_fraction"] = 0.5
    with pytest.raises(
        ValueError,
        match=r"device_step_fraction 0.5 streams fp32 moments; with optimizer.params."
        r"state_dtype = 'int8' set it to 0",
    ):
        run(cfg, 1)


def test_deepspeeds_bf16_optimizer_states_key_stores_the_moments_in_bf16():
    """DeepSpeed's own example config (bf16, ZeRO-3, ``bf16.bf16_optimizer_states: true``) without the two keys
    plait refuses (``bf16_master_weights_and_grads``, ``torch_autocast``): the moments are bf16 tensors."""
    cfg = json.loads(
        (Path(__file__).parent / "data" / "ds_configs" / "dsexamples__bf16_full.json").read_text()
    )
    del cfg["bf16"]["bf16_master_weights_and_grads"], cfg["torch_autocast"]
    mesh = ParallelMesh()
    engine = plait.initialize(TransformerModel(tiny(), mesh, seed=5), cfg, mesh=mesh)
    batch = micro_batch(0, 0, 0, micro=4)
    losses = []
    for _ in range(2):
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    opt = engine.optimizer.optimizer
    assert opt.state_dtype == "bf16" and engine.global_steps == 2
    assert {st["exp_avg"].dtype for st in opt.state.values()} == {torch.bfloat16}
    assert all(math.isfinite(x) for x in losses)
    engine.optimizer.close()


def _dp2_body():
    return [run(config("int8", offload), 4) for offload in (True, False)]


def test_int8_moments_at_dp2_offloaded_and_not_step_alike():
    """Two gloo ranks, ZeRO-2: a parameter split between the ranks' shards starts a block at the split on both
    sides, offloaded (numba on the host) and not (the same kernels over the device masters): bit for bit."""
    (on, off), _ = run_distributed(_dp2_body, 2, timeout_s=300)
    assert on["losses"] == off["losses"] and on["losses"][-1] < on["losses"][0]
    for name, w in off["weights"].items():
        assert torch.equal(on["weights"][name], w), name
