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
the one taken."""
import functools
import itertools
import math
import os
import tempfile
import time
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import plait
from plait.config import ConfigError
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.testing import run_distributed
from plait.zero import ClipOptions, CommOptions, PrecisionOptions, ZeroOptimizer, weight_decay_groups
from plait.zero.offload import HostOptimizer, HostStepper, OffloadOptions
from helpers import micro_batch, rel_err, tiny

STEPS, MICRO, SEQ = 5, 2, 16


def ds_config(stage, offload=False, param=False, clip=0.5, gas=2, fp16=False, bf16=False, device_step=0.0, ratio=1.0):
    """Early host steps (during backward) need clipping, fp16 and the non-finite guard off: with ``clip``
    0 the guard is turned off too (a step already applied during backward cannot be skipped)."""
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                        "warmup_num_steps": 3, "warmup_type": "linear"}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 3000,
                                 "stage3_param_persistence_threshold": 100, "overlap_comm": stage == 3},
           "nonfinite_guard": {"enabled": clip > 0}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True,
                                                         "device_step_fraction": device_step, "ratio": ratio}
    if param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    if bf16:  # bf16 reduction, so at dp 2 the host gradient shard is bf16 too (plait.zero.offload)
        cfg["bf16"] = {"enabled": True}
        cfg["communication_data_type"] = "bf16"
    return cfg


def whole(engine):
    with engine.optimizer.gathered_parameters():
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


@contextmanager
def slow_host_steps(seconds):
    """Every host segment step sleeps ``seconds`` first, so ``step()`` returns mid-flight."""
    orig = HostOptimizer.step_range

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return orig(self, *args, **kwargs)

    HostOptimizer.step_range = slow
    try:
        yield
    finally:
        HostOptimizer.step_range = orig


# The reference: the non-offloaded engine stepping its (device-resident) fp32 masters with plait's CPU
# AdamW kernel, the arithmetic the offloaded step uses. Both paths take the clip coefficient from a
# float64 gradient norm (plait.zero.clip.global_grad_norm / sum_squares64: orders differ by ~1e-16, far
# below the float32 rounding of the coefficient) and multiply the float32 gradient by it, so an offloaded
# run equals this one bit for bit by construction, on any CPU. Against torch's AdamW the kernel differs
# in the last bits of each update (torch's lerp and its fused multiply-adds depend on the CPU's vector
# ISA); training amplifies such differences chaotically (3 steps at lr 1e-2: 1.6e-6 on the whole weight),
# so that comparison is made per step, where it is bounded (tests/test_kernels.py).
HOST_ADAMW = functools.partial(HostOptimizer, kind="adamw", lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))


def reference(cfg, steps, **kwargs):
    return train(cfg, steps, optimizer=HOST_ADAMW, **kwargs)


def train(cfg, steps, start=0, load=None, save=None, poison=None, device="cpu", optimizer=None):
    """Engine run; ``poison(step, rank)`` multiplies that rank's loss by inf. The model is built on the
    CPU and moved to ``device`` (tests/gpu/run_offload_gpu.py runs these cases on a GPU, against torch's
    AdamW). ``optimizer``: as ``plait.initialize``'s (None: the config's)."""
    mesh = ParallelMesh()
    model = TransformerModel(tiny(), mesh, seed=5).to(device)
    # a user's optimizer factory gets the config's weight-decay grouping only when handed the groups
    groups = [g for g in weight_decay_groups(model, 0.1) if g["params"]] if optimizer is not None else None
    engine = plait.initialize(model, cfg, mesh=mesh, optimizer=optimizer, model_parameters=groups)
    if load:
        engine.load_checkpoint(load)
    gas, losses = cfg["gradient_accumulation_steps"], []
    for step in range(start, start + steps):
        total = 0.0
        for j in range(gas):
            loss = engine(**{k: v.to(device) for k, v in micro_batch(step, j, mesh.dp_rank).items()})
            bad = poison is not None and poison(step, mesh.dp_rank)
            engine.backward(loss * math.inf if bad else loss)
            engine.step()
            total += float(loss) / gas
        losses.append(total)
    if save:
        engine.save_checkpoint(save)
    masters = {(s.name, s.start): s.master.clone() for s in engine.optimizer.shard_state().slices}
    host = engine.optimizer.stepper if isinstance(engine.optimizer.stepper, HostStepper) else None
    stepper = host.share if host is not None else None
    opt = engine.optimizer
    out = {"dp": mesh.dp, "grad_dtype": opt.grad_shards[-1].dtype,   # the last group: on the host unless every state is resident
           "placed": [(g.key.resident, m.numel(), m.device.type, st["exp_avg"].device.type) for g, m, st in
                      zip(opt.groups, opt.masters, (opt.optimizer.state.get(m, {"exp_avg": m}) for m in opt.masters))],
           "device_stepped": len(stepper.ids) if stepper is not None else 0,
           "split_history": list(stepper.history) if stepper is not None else [],
           "weights": whole(engine), "masters": masters, "losses": losses, "steps": engine.global_steps,
           "skipped": engine.skipped_steps, "norm": engine.grad_norm, "lr": engine.get_lr()[0]}
    if host is not None:
        out["overlap"] = dict(host.ready.stats)
    engine.optimizer.close()
    return out


CASES = {  # name: (reference config, offloaded config)
    "stage1": (ds_config(1), ds_config(1, offload=True)),
    "stage2": (ds_config(2), ds_config(2, offload=True)),
    "stage3": (ds_config(3), ds_config(3, offload=True)),
    "stage3+param": (ds_config(3), ds_config(3, offload=True, param=True)),
    "stage3 param only": (ds_config(3), ds_config(3, param=True)),
    "stage2 early (no clip, GAS 1)": (ds_config(2, clip=0.0, gas=1), ds_config(2, offload=True, clip=0.0, gas=1)),
    "stage3+param early": (ds_config(3, clip=0.0, gas=1), ds_config(3, offload=True, param=True, clip=0.0, gas=1)),
    # bf16 at GAS 1: bf16 gradient shards on the host, read as is by the kernels and the norm
    "bf16 stage2 (bf16 host grads)": (ds_config(2, gas=1, bf16=True), ds_config(2, offload=True, gas=1, bf16=True)),
    "bf16 stage3+param (bf16 host grads)": (ds_config(3, gas=1, bf16=True),
                                            ds_config(3, offload=True, param=True, gas=1, bf16=True)),
    # device-assisted host step (plait.zero.offload.device_share): the first half of the partition in forward
    # order is updated by the device from the host states, the rest by the CPU kernels
    "stage2 device step 0.5": (ds_config(2, gas=1), ds_config(2, offload=True, gas=1, device_step=0.5)),
    "stage1 device step 0.3, no clip": (ds_config(1, gas=1, clip=0.0),
                                        ds_config(1, offload=True, gas=1, clip=0.0, device_step=0.3)),
    "stage3 device step 0.6": (ds_config(3, gas=1), ds_config(3, offload=True, gas=1, device_step=0.6)),
    "bf16 stage2 device step 0.5": (ds_config(2, gas=1, bf16=True),
                                    ds_config(2, offload=True, gas=1, bf16=True, device_step=0.5)),
    # no clipping: with a device share the deferred mode still runs (both shares at step())
    "bf16 stage2 device step 0.3, no clip": (ds_config(2, gas=1, bf16=True, clip=0.0),
                                             ds_config(2, offload=True, gas=1, bf16=True, clip=0.0, device_step=0.3)),
    # GPU-first placement (plait.zero.offload.placement): the states of the first 1 - ratio of the partition in
    # forward order live on the device and are stepped there; the rest on the host (with a device share too)
    "stage2 ratio 0.5": (ds_config(2, gas=1), ds_config(2, offload=True, gas=1, ratio=0.5)),
    "stage3 ratio 0.3, device step 0.5": (ds_config(3, gas=1), ds_config(3, offload=True, gas=1, ratio=0.3,
                                                                         device_step=0.5)),
    "bf16 stage2 ratio 0": (ds_config(2, gas=1, bf16=True), ds_config(2, offload=True, gas=1, bf16=True, ratio=0.0)),
    # GAS 2: a resident group accumulates its gradient in its device shard (no device share of the host part)
    "stage1 ratio 0.5, GAS 2": (ds_config(1), ds_config(1, offload=True, ratio=0.5)),
    "stage3 ratio 0.4, GAS 2": (ds_config(3), ds_config(3, offload=True, ratio=0.4)),
}


def _body(ckpt_dir):
    rank = dist.get_rank()
    out = {}
    for name, (ref_cfg, off_cfg) in CASES.items():
        host_step = "offload_optimizer" in off_cfg["zero_optimization"]   # else torch's AdamW on both sides
        out[name] = ((reference if host_step else train)(ref_cfg, STEPS), train(off_cfg, STEPS))
    # device-assisted host step vs the all-CPU host step, 5 steps: bit-identical (same updates, and at
    # GAS 1 the norm is taken on the device for every segment whichever side steps it)
    for bf16 in (False, True):
        out[f"device step bitwise bf16={bf16}"] = (
            train(ds_config(2, offload=True, gas=1, bf16=bf16), STEPS),
            train(ds_config(2, offload=True, gas=1, bf16=bf16, device_step=0.5), STEPS))
    # adaptive split: the CPU share is slowed down, so the device share grows at every step
    with slow_host_steps(0.01):
        adaptive = ds_config(2, offload=True, gas=1, device_step="auto")
        out["device step adaptive"] = (train(ds_config(2, offload=True, gas=1), STEPS), train(adaptive, STEPS))
    # fp16: rank 1 (or rank 0 at dp 1) overflows on step 1; the step is skipped everywhere
    bad = dist.get_world_size() - 1
    poison = functools.partial(_poison, bad)
    out["fp16 overflow"] = (reference(ds_config(2, fp16=True), 4, poison=poison),
                            train(ds_config(2, offload=True, fp16=True), 4, poison=poison))
    # checkpoints across offload on/off: 3 steps, save, load into the other mode, 2 more steps
    for tag, first, second in (("on->off", True, False), ("off->on", False, True)):
        path = os.path.join(ckpt_dir, tag.replace(">", ""))
        (train if first else reference)(ds_config(2, offload=first), 3, save=path)
        out[f"checkpoint {tag}"] = (reference(ds_config(2), STEPS),
                                    (train if second else reference)(ds_config(2, offload=second), 2, start=3,
                                                                     load=path))
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
                f"{part} {key} off by {rel_err(got[part][key], want, floor=1e-12):.2e}")


@pytest.mark.parametrize("case", list(CASES))
def test_offload_matches_device_optimizer(results, case):
    ref, got = results[case]
    assert got["steps"] == ref["steps"] == STEPS and got["lr"] == ref["lr"]
    assert got["losses"] == ref["losses"], case
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-15)   # float64 sums in another order
    # a placement gives the resident parameters flat groups of their own, so at dp 2 each rank's slices start
    # elsewhere: there the whole weights are compared (and the masters at dp 1, where every slice is whole)
    _assert_identical(ref, got, ("weights",) if "ratio" in case and got["dp"] > 1 else ("weights", "masters"))
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
    history = adaptive["split_history"]          # segments on the device, per step (starts at 0)
    assert history[0] == 0 and history[-1] >= 3 and all(b > a for a, b in itertools.pairwise(history))
    for key, m in cpu["masters"].items():
        assert torch.equal(adaptive["masters"][key].view(torch.int32), m.view(torch.int32)), key


def test_fp16_overflow_on_one_rank_skips_the_offloaded_step(results):
    ref, got = results["fp16 overflow"]
    assert got["skipped"] == ref["skipped"] == 1 and got["steps"] == ref["steps"] == 4   # DeepSpeed counts the skip
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


def _zero(stage, offload, clip=1.0, gas=1, overlap=True, optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    model = TransformerModel(tiny(), None, seed=5)
    off = OffloadOptions(overlap_step=overlap) if offload else None
    return model, ZeroOptimizer(model, None, stage=stage, optimizer=optimizer,
                                optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
                                comm=CommOptions(reduce_bucket_size=2000, allgather_bucket_size=3000,
                                                 param_persistence_threshold=100),
                                gradient_accumulation_steps=gas, clip=ClipOptions(clip), offload=off,
                                # early host steps (clip 0) need the guard off
                                precision=PrecisionOptions(skip_nonfinite=clip > 0),
                                units=list(model.layers.values()) if stage == 3 else None)


def _masters(opt):
    return {s.name + str(s.start): s.master.clone() for s in opt.shard_state().slices}


@pytest.mark.parametrize("stage,clip,gas", [(1, 1.0, 2), (2, 1.0, 1), (2, 0.0, 1), (3, 1.0, 2)],
                         ids=["stage1 clip GAS2", "stage2 clip", "stage2 early", "stage3 clip GAS2"])
def test_step_returns_mid_flight_and_the_next_forward_waits_per_segment(stage, clip, gas):
    """Exact, by construction: the reference is the non-offloaded ``ZeroOptimizer`` stepping with the same
    CPU kernel (``HostOptimizer``), and both take the clip coefficient from a float64 norm
    (``global_grad_norm`` / ``sum_squares64``) and multiply the float32 gradient by it. So any
    difference is a fault of the offload pipeline (a forward reading a weight before its segment
    landed, a segment stepped twice or with another coefficient), never rounding; the comparison
    against torch's AdamW, whose element arithmetic differs by design, is ``test_offload_matches_device_optimizer``."""
    host_adamw = functools.partial(HostOptimizer, kind="adamw")
    (ref_model, ref), (model, opt) = _zero(stage, False, clip, gas, optimizer=host_adamw), _zero(stage, True, clip, gas)
    batches = [micro_batch(s, j, 0) for s in range(3) for j in range(gas)]
    with slow_host_steps(0.01):
        for i, b in enumerate(batches):
            ref.backward(ref_model(**b))
            ref.step()
            opt.backward(model(**b))
            if opt.step():
                assert opt.stepper.ready.active  # step() returned before the host step ended
                if i == len(batches) - 1:       # last step: a checkpoint read right away waits first
                    got = _masters(opt)
                    assert not opt.stepper.ready.active
                    break
                waits = opt.stepper.ready.stats["waits"]
                with torch.no_grad():
                    probe, want = model(**batches[0]), ref_model(**batches[0])
                assert torch.equal(probe, want)   # read mid-flight: every weight already updated
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
    opt = ZeroOptimizer(model, None, stage=2, optimizer=lion, optimizer_kwargs={"lr": 1e-3},
                        offload=OffloadOptions())
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(torch.randn(4, 8)).square().mean())
    assert opt.step()
    opt.synchronize()   # the host step may still run (overlap_step); parameters read outside a forward wait here
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    assert all(m.device.type == "cpu" for m in opt.masters) and "exp_avg" in opt.shard_state().slices[0].state
    opt.close()
    with pytest.raises(ValueError, match="cannot run offloaded"):
        ZeroOptimizer(torch.nn.Linear(4, 4), None, stage=2, optimizer=torch.optim.SGD,
                      optimizer_kwargs={"lr": 0.1}, offload=OffloadOptions())
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
    assert engine.optimizer.stepper.share is not None and engine.optimizer.offload_options.device_step_fraction == 0.4
    engine.optimizer.close()
