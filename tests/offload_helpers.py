"""What the offload tests share (test_offload.py, test_offload_zero_optimizer.py, test_offload_placement.py,
test_lowbit_engine.py, gpu/run_offload_gpu.py): the ds_config of a ZeRO-Offload run, an engine run and its
bit-exact reference (``reference``), the parity cases ``CASES``, and a host optimizer slowed down."""

import functools
import math
import time
from contextlib import contextmanager

import plait
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.zero import weight_decay_groups
from plait.zero.offload import HostOptimizer, HostStepper
from helpers import micro_batch, tiny

STEPS, MICRO, SEQ = 5, 2, 16


def ds_config(
    stage,
    offload=False,
    param=False,
    clip=0.5,
    gas=2,
    fp16=False,
    bf16=False,
    device_step=0.0,
    ratio=1.0,
):
    """Early host steps (during backward) need clipping, fp16 and the non-finite guard off: with ``clip``
    0 the guard is turned off too (a step already applied during backward cannot be skipped)."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 3e-3,
                "warmup_num_steps": 3,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 2000,
            "allgather_bucket_size": 3000,
            "stage3_param_persistence_threshold": 100,
            "overlap_comm": stage == 3,
        },
        "nonfinite_guard": {"enabled": clip > 0},
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": "cpu",
            "pin_memory": True,
            "device_step_fraction": device_step,
            "ratio": ratio,
        }
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
HOST_ADAMW = functools.partial(
    HostOptimizer, kind="adamw", lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95)
)


def reference(cfg, steps, **kwargs):
    return train(cfg, steps, optimizer=HOST_ADAMW, **kwargs)


def train(cfg, steps, start=0, load=None, save=None, poison=None, device="cpu", optimizer=None):
    """Engine run; ``poison(step, rank)`` multiplies that rank's loss by inf. The model is built on the
    CPU and moved to ``device`` (tests/gpu/run_offload_gpu.py runs these cases on a GPU, against torch's
    AdamW). ``optimizer``: as ``plait.initialize``'s (None: the config's)."""
    mesh = ParallelMesh()
    model = TransformerModel(tiny(), mesh, seed=5).to(device)
    # a user's optimizer factory gets the config's weight-decay grouping only when handed the groups
    groups = (
        [g for g in weight_decay_groups(model, 0.1) if g["params"]]
        if optimizer is not None
        else None
    )
    engine = plait.initialize(model, cfg, mesh=mesh, optimizer=optimizer, model_parameters=groups)
    if load:
        engine.load_checkpoint(load)
    gas, losses = cfg["gradient_accumulation_steps"], []
    for step in range(start, start + steps):
        total = 0.0
        for j in range(gas):
            loss = engine(
                **{k: v.to(device) for k, v in micro_batch(step, j, mesh.dp_rank).items()}
            )
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
    out = {
        "dp": mesh.dp,
        "grad_dtype": opt.grad_shards[
            -1
        ].dtype,  # the last group: on the host unless every state is resident
        "placed": [
            (g.key.resident, m.numel(), m.device.type, st["exp_avg"].device.type)
            for g, m, st in zip(
                opt.groups,
                opt.masters,
                (opt.optimizer.state.get(m, {"exp_avg": m}) for m in opt.masters),
            )
        ],
        "device_stepped": len(stepper.ids) if stepper is not None else 0,
        "split_history": list(stepper.history) if stepper is not None else [],
        "weights": whole(engine),
        "masters": masters,
        "losses": losses,
        "steps": engine.global_steps,
        "skipped": engine.skipped_steps,
        "norm": engine.grad_norm,
        "lr": engine.get_lr()[0],
    }
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
    "stage2 early (no clip, GAS 1)": (
        ds_config(2, clip=0.0, gas=1),
        ds_config(2, offload=True, clip=0.0, gas=1),
    ),
    "stage3+param early": (
        ds_config(3, clip=0.0, gas=1),
        ds_config(3, offload=True, param=True, clip=0.0, gas=1),
    ),
    # bf16 at GAS 1: bf16 gradient shards on the host, read as is by the kernels and the norm
    "bf16 stage2 (bf16 host grads)": (
        ds_config(2, gas=1, bf16=True),
        ds_config(2, offload=True, gas=1, bf16=True),
    ),
    "bf16 stage3+param (bf16 host grads)": (
        ds_config(3, gas=1, bf16=True),
        ds_config(3, offload=True, param=True, gas=1, bf16=True),
    ),
    # device-assisted host step (plait.zero.offload.device_share): the first half of the partition in forward
    # order is updated by the device from the host states, the rest by the CPU kernels
    "stage2 device step 0.5": (
        ds_config(2, gas=1),
        ds_config(2, offload=True, gas=1, device_step=0.5),
    ),
    "stage1 device step 0.3, no clip": (
        ds_config(1, gas=1, clip=0.0),
        ds_config(1, offload=True, gas=1, clip=0.0, device_step=0.3),
    ),
    "stage3 device step 0.6": (
        ds_config(3, gas=1),
        ds_config(3, offload=True, gas=1, device_step=0.6),
    ),
    "bf16 stage2 device step 0.5": (
        ds_config(2, gas=1, bf16=True),
        ds_config(2, offload=True, gas=1, bf16=True, device_step=0.5),
    ),
    # no clipping: with a device share the deferred mode still runs (both shares at step())
    "bf16 stage2 device step 0.3, no clip": (
        ds_config(2, gas=1, bf16=True, clip=0.0),
        ds_config(2, offload=True, gas=1, bf16=True, clip=0.0, device_step=0.3),
    ),
    # GPU-first placement (plait.zero.offload.placement): the states of the first 1 - ratio of the partition in
    # forward order live on the device and are stepped there; the rest on the host (with a device share too)
    "stage2 ratio 0.5": (ds_config(2, gas=1), ds_config(2, offload=True, gas=1, ratio=0.5)),
    "stage3 ratio 0.3, device step 0.5": (
        ds_config(3, gas=1),
        ds_config(3, offload=True, gas=1, ratio=0.3, device_step=0.5),
    ),
    "bf16 stage2 ratio 0": (
        ds_config(2, gas=1, bf16=True),
        ds_config(2, offload=True, gas=1, bf16=True, ratio=0.0),
    ),
    # GAS 2: a resident group accumulates its gradient in its device shard (no device share of the host part)
    "stage1 ratio 0.5, GAS 2": (ds_config(1), ds_config(1, offload=True, ratio=0.5)),
    "stage3 ratio 0.4, GAS 2": (ds_config(3), ds_config(3, offload=True, ratio=0.4)),
}
