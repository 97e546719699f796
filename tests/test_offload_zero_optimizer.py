"""ZeRO-Offload's ``ZeroOptimizer`` in one process: the overlapped host step (``overlap_step``) returns
mid-flight and the next forward waits per segment, exactly as the non-offloaded step with the same CPU kernel;
overlap off finishes inside ``step()``; Lion offloaded, and the errors naming the fix; the ds_config's
``device_step_fraction`` reaching the host stepper. The engine-level parity runs are tests/test_offload.py's."""

import functools

import pytest
import torch

import plait
from plait.config import ConfigError
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.zero import ClipOptions, CommOptions, PrecisionOptions, ZeroOptimizer
from plait.zero.offload import HostOptimizer, OffloadOptions
from helpers import micro_batch, rel_err, tiny
from offload_helpers import ds_config, slow_host_steps


def _zero(stage, offload, clip=1.0, gas=1, overlap=True, optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    model = TransformerModel(tiny(), None, seed=5)
    off = OffloadOptions(overlap_step=overlap) if offload else None
    return model, ZeroOptimizer(
        model,
        None,
        stage=stage,
        optimizer=optimizer,
        optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
        comm=CommOptions(
            reduce_bucket_size=2000, allgather_bucket_size=3000, param_persistence_threshold=100
        ),
        gradient_accumulation_steps=gas,
        clip=ClipOptions(clip),
        offload=off,
        # early host steps (clip 0) need the guard off
        precision=PrecisionOptions(skip_nonfinite=clip > 0),
        units=list(model.layers.values()) if stage == 3 else None,
    )


def _masters(opt):
    return {s.name + str(s.start): s.master.clone() for s in opt.shard_state().slices}


@pytest.mark.parametrize(
    "stage,clip,gas",
    [(1, 1.0, 2), (2, 1.0, 1), (2, 0.0, 1), (3, 1.0, 2)],
    ids=["stage1 clip GAS2", "stage2 clip", "stage2 early", "stage3 clip GAS2"],
)
def test_step_returns_mid_flight_and_the_next_forward_waits_per_segment(stage, clip, gas):
    """Exact, by construction: the reference is the non-offloaded ``ZeroOptimizer`` stepping with the same
    CPU kernel (``HostOptimizer``), and both take the clip coefficient from a float64 norm
    (``global_grad_norm`` / ``sum_squares64``) and multiply the float32 gradient by it. So any
    difference is a fault of the offload pipeline (a forward reading a weight before its segment
    landed, a segment stepped twice or with another coefficient), never rounding; the comparison
    against torch's AdamW, whose element arithmetic differs by design, is ``test_offload_matches_device_optimizer``."""
    host_adamw = functools.partial(HostOptimizer, kind="adamw")
    (ref_model, ref), (model, opt) = (
        _zero(stage, False, clip, gas, optimizer=host_adamw),
        _zero(stage, True, clip, gas),
    )
    batches = [micro_batch(s, j, 0) for s in range(3) for j in range(gas)]
    with slow_host_steps(0.01):
        for i, b in enumerate(batches):
            ref.backward(ref_model(**b))
            ref.step()
            opt.backward(model(**b))
            if opt.step():
                assert opt.stepper.ready.active  # step() returned before the host step ended
                if i == len(batches) - 1:  # last step: a checkpoint read right away waits first
                    got = _masters(opt)
                    assert not opt.stepper.ready.active
                    break
                waits = opt.stepper.ready.stats["waits"]
                with torch.no_grad():
                    probe, want = model(**batches[0]), ref_model(**batches[0])
                assert torch.equal(probe, want)  # read mid-flight: every weight already updated
                assert not opt.stepper.ready.active and opt.stepper.ready.stats["waits"] > waits + 1
        # deferred (clip): host steps still running after step(); early: done during backward
        assert (opt.stepper.ready.stats["segments_in_flight"] > 0) == (clip > 0)
        assert opt.stepper.ready.stats["steps"] == 3
    want = _masters(ref)
    assert got.keys() == want.keys()
    for k, m in want.items():
        assert torch.equal(got[k], m), (k, rel_err(got[k], m, floor=1e-12))
    opt.zero_grad()
    opt.close()


def test_overlap_off_finishes_inside_step():
    model, opt = _zero(2, True, overlap=False)
    opt.backward(model(**micro_batch(0, 0, 0)))
    assert opt.step() and not opt.stepper.ready.active
    opt.close()


# ---- single process: the errors and the ds_config path ------------------------------------------
def test_lion_offload_runs_and_errors_name_the_fix():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    lion = functools.partial(HostOptimizer, kind="lion")
    opt = ZeroOptimizer(
        model,
        None,
        stage=2,
        optimizer=lion,
        optimizer_kwargs={"lr": 1e-3},
        offload=OffloadOptions(),
    )
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(torch.randn(4, 8)).square().mean())
    assert opt.step()
    opt.synchronize()  # the host step may still run (overlap_step); parameters read outside a forward wait here
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    assert (
        all(m.device.type == "cpu" for m in opt.masters)
        and "exp_avg" in opt.shard_state().slices[0].state
    )
    opt.close()
    with pytest.raises(ValueError, match="cannot run offloaded"):
        ZeroOptimizer(
            torch.nn.Linear(4, 4),
            None,
            stage=2,
            optimizer=torch.optim.SGD,
            optimizer_kwargs={"lr": 0.1},
            offload=OffloadOptions(),
        )
    with pytest.raises(ValueError, match="stage"):
        ZeroOptimizer(torch.nn.Linear(4, 4), None, stage=2, offload=OffloadOptions(param=True))
    cfg = ds_config(2, offload=True)
    cfg["optimizer"] = {"type": "LAMB", "params": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match="LAMB"):
        plait.initialize(TransformerModel(tiny(), None, seed=5), cfg, mesh=ParallelMesh())


def test_device_step_fraction_reaches_the_host_stepper_from_ds_config():
    """The key sits in offload_optimizer (its refusals: tests/test_offload_options.py)."""
    cfg = ds_config(2, offload=True, gas=1, device_step=0.4)
    engine = plait.initialize(TransformerModel(tiny(), None, seed=5), cfg, mesh=ParallelMesh())
    assert (
        engine.optimizer.stepper.share is not None
        and engine.optimizer.offload_options.device_step_fraction == 0.4
    )
    engine.optimizer.close()
