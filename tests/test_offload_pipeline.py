"""ZeRO-Offload (``zero_optimization.offload_optimizer``, stages 1-3; stage 3 also with ``offload_param``) through
a pipeline engine (``engine.train_batch`` over a ``PipelineParallel``), CPU/gloo, on a Llama whose embedding is
tied to the LM head across the first and the last stage (the pipeline sums the two copies' gradients after its
schedule, in the host gradient shards under offload: ``plait.engine.pipeline``).

Two references, two tolerances:

* exact (tolerance 0, every loss and every weight element): the same pipeline engine WITHOUT offload stepping
  its device-resident fp32 masters with plait's CPU AdamW kernel (``HOST_ADAMW``), the arithmetic the offloaded
  step runs. Both take the clip coefficient from a float64 gradient norm whose summation orders differ by
  ~1e-16 relative, far below the float32 rounding of the coefficient, and multiply the float32 gradients by
  it, so equality holds by construction (as in tests/test_offload.py); any lost or doubled contribution
  (the tied sum, a micro-batch, a norm or a step taken before the sum) shows as a difference.
* float32 torch AdamW (the config's optimizer) without offload: the kernel and torch round the update
  differently in the last bits (torch's lerp and fused multiply-adds follow the CPU's vector ISA; per step
  within ~1e-7 relative, tests/test_kernels.py), and later gradients carry those differences on. Over
  ``STEPS`` = 3 steps at lr 3e-3 the measured differences were at most 1.7e-7 norm-relative per weight tensor
  and 8.6e-8 relative on the losses (one float32 ulp of a loss near 5.5), so ``TORCH_TOL`` = 1e-5
  (norm-relative per tensor) and ``TORCH_LOSS_TOL`` = 1e-6 (~10 ulp) leave a margin of ~10-60 for other
  CPUs and ISAs, while an engine that skips the tied sum is off by ~0.2 on the weights and ~5e-4 on the
  losses (asserted here too, so the check is shown to catch it), and one that drops a micro-batch by ~0.45
  (checked by hand when written).
"""

import functools
import time

import pytest
import torch
import torch.distributed as dist

import plait
from plait.config import ConfigError
from plait.engine.pipeline import settle_landings
from plait.layers.stages import build_stage_modules
from plait.parallel import ParallelMesh
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.parallel.sharding import gather_logical_state
from plait.testing import run_distributed
from plait.zero import ZeroOptimizer, weight_decay_groups
from plait.zero.offload import HostOptimizer, OffloadOptions
from plait.zero.offload.landing import Landing
from helpers import micro_batch, rel_err, tiny

STEPS, LR = 3, 3e-3
TORCH_TOL, TORCH_LOSS_TOL = 1e-5, 1e-6
HOST_ADAMW = functools.partial(
    HostOptimizer, kind="adamw", lr=LR, weight_decay=0.1, betas=(0.9, 0.95)
)
# (schedule, ZeRO stage, offload_param, gradient clipping, GAS): clipping 0 also turns the non-finite guard
# off, the configuration in which offload steps segments early during backward without a pipeline
CASES = [
    ("1f1b", 1, False, 0.5, 2),
    ("1f1b", 2, False, 0.5, 2),
    ("1f1b", 3, True, 0.5, 2),
    ("zb-h1", 2, False, 0.0, 1),
    ("zb-h1", 3, True, 0.5, 2),
    ("interleaved", 2, False, 0.5, 2),
    ("interleaved", 3, False, 0.0, 2),
]


def config(schedule, stage, param, clip, gas, pp, offload=True, device_step=None, bucket=2000):
    v = 2 if schedule == "interleaved" else 1
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": 3000,
            "stage3_param_persistence_threshold": 100,
        },
        "nonfinite_guard": {"enabled": clip > 0},
        "pipeline": {"size": pp, "schedule": schedule, "virtual_stages": v},
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": "cpu",
            "pin_memory": True,
            "device_step_fraction": device_step,
        }
    if param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def train(cfg, mesh=None, kernel=True, skip_tied_sum=False):
    """``STEPS`` pipeline steps of the tied Llama (this rank's chunks) -> (losses, {name: whole fp32 weight}).
    ``kernel``: step with ``HOST_ADAMW`` (else the config's torch AdamW); ``skip_tied_sum``: the broken engine."""
    p = cfg["pipeline"]
    chunks = build_stage_modules(
        tiny().replace(tie_embeddings=True),
        mesh if p["size"] > 1 else None,
        v=p["virtual_stages"],
        seed=5,
    )
    pipe = PipelineParallel(
        chunks,
        mesh if p["size"] > 1 else None,
        schedule=p["schedule"],
        micro_batches=cfg["gradient_accumulation_steps"],
    )
    if skip_tied_sum:
        pipe.sum_tied_gradients = lambda grads=None: None
    groups = [g for g in weight_decay_groups(torch.nn.ModuleList(chunks), 0.1) if g["params"]]
    kwargs = {"optimizer": HOST_ADAMW, "model_parameters": groups} if kernel else {}
    engine = plait.initialize(pipe, cfg, mesh=mesh or ParallelMesh(), **kwargs)
    dp_rank, gas = engine.mesh.dp_rank, cfg["gradient_accumulation_steps"]
    losses = [
        engine.train_batch(iter([micro_batch(s, j, dp_rank) for j in range(gas)])).item()
        for s in range(STEPS)
    ]
    weights = {}
    with engine.optimizer.gathered_parameters():
        for chunk in chunks:
            weights.update(
                {n: t.detach().float().clone() for n, t in gather_logical_state(chunk).items()}
            )
    engine.optimizer.close()
    return losses, weights


def compare(got, ref):
    """(loss curves equal, largest elementwise weight difference, largest norm-relative difference of a weight
    tensor, largest relative difference of a loss)."""
    assert set(got[1]) == set(ref[1])
    diff = max((got[1][n] - ref[1][n]).abs().max().item() for n in ref[1])
    rel = max(rel_err(got[1][n], ref[1][n], floor=1e-12) for n in ref[1])
    return got[0] == ref[0], diff, rel, max(abs(a - b) / abs(b) for a, b in zip(got[0], ref[0]))


def pipeline_body(pp, cases, against_torch=True):
    """Per case: the offloaded engine against the non-offloaded one (same kernel); with ``against_torch``, for
    the first case also against torch AdamW, and the broken engine (no tied sum) against the same reference."""
    mesh = ParallelMesh(pp=pp)
    out = {}
    for case in cases:
        offloaded = train(config(*case, pp), mesh)
        out[case] = compare(offloaded, train(config(*case, pp, offload=False), mesh))
    if not against_torch:
        return out, dist.get_rank()
    first = config(*cases[0], pp)
    torch_ref = train(config(*cases[0], pp, offload=False), mesh, kernel=False)
    out["torch"] = compare(train(first, mesh), torch_ref)
    out["broken"] = compare(train(first, mesh, skip_tied_sum=True), torch_ref)
    return out, dist.get_rank()


def check(per_rank):
    for out, rank in per_rank:
        for case, (same_losses, diff, _, _) in out.items():
            if case not in ("torch", "broken"):
                assert same_losses and diff == 0.0, (
                    f"rank {rank} {case}: offloaded run differs by {diff:.3e}"
                )
        if "torch" not in out:
            continue
        _, _, rel, loss_rel = out["torch"]
        assert rel <= TORCH_TOL and loss_rel <= TORCH_LOSS_TOL, (
            f"rank {rank} vs torch AdamW: {rel:.2e}, {loss_rel:.2e}"
        )
        _, _, broken_rel, _ = out["broken"]
        assert broken_rel > 100 * TORCH_TOL, (
            f"rank {rank}: skipping the tied sum went unnoticed ({broken_rel:.2e})"
        )


def test_offload_with_pipeline_stages_and_schedules_equals_the_device_optimizer():
    """pp=2, dp=1: 1f1b (stages 1, 2, 3 + offload_param), zb-h1 (stage 2, GAS 1, no clipping) and interleaved
    (stages 2 and 3, v=2), tied embeddings; plus the torch-AdamW tolerance and the broken engine."""
    check(run_distributed(pipeline_body, 2, 2, CASES, timeout_s=300))


def test_offload_with_pipeline_and_data_parallel_equals_the_device_optimizer():
    """pp=2 x dp=2: the tied sum over dp ranks' host gradient shards (ZeRO-2) and stage 3 + offload_param."""
    cases = [("1f1b", 2, False, 0.5, 2), ("interleaved", 3, True, 0.5, 2)]
    check(run_distributed(pipeline_body, 4, 2, cases, False, timeout_s=300))


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_with_tied_chunks_on_one_rank(stage, monkeypatch):
    """One process, interleaved v=2: the embedding and its head copy are two chunks of one rank (the sum of
    ``PipelineParallel.sum_tied_gradients`` at p = 1), both in this rank's host gradient shards. The worker's
    landings are slowed down, so a tied sum that did not wait for them (``settle_landings``) would read host
    gradient shards whose last landings are still queued (checked by hand: off by ~1.6e-2)."""
    cfg = config(
        "interleaved", stage, False, 0.5, 2, 1, bucket=10_000
    )  # a few segments: few slowed landings
    ref = train(config("interleaved", stage, False, 0.5, 2, 1, offload=False, bucket=10_000))
    landed = Landing._landed

    def slow_landing(self, *args):
        time.sleep(0.002)
        return landed(self, *args)

    monkeypatch.setattr(Landing, "_landed", slow_landing)
    same_losses, diff, _, _ = compare(train(cfg), ref)
    assert same_losses and diff == 0.0, f"offloaded run differs by {diff:.3e}"
    monkeypatch.undo()
    broken = compare(train(cfg, skip_tied_sum=True), ref)
    assert broken[1] > 1e-3


def test_device_share_with_pipeline_is_refused_naming_the_fix():
    cfg = config("interleaved", 2, False, 0.5, 2, 1, device_step=0.5)
    chunks = build_stage_modules(tiny().replace(tie_embeddings=True), None, v=2, seed=5)
    with pytest.raises(
        ConfigError, match=r"device_step_fraction = 0.5 with pipeline parallelism.*set it to 0"
    ):
        plait.initialize(
            PipelineParallel(chunks, None, schedule="interleaved", micro_batches=2), cfg
        )


def test_tied_sum_refuses_an_offload_that_finalizes_gradients_during_backward():
    """A ZeroOptimizer built by hand for a pipeline without ``final_at_step`` would take norms and early host
    steps before the tied sum: ``settle_landings`` (the sum's first step) says so instead."""
    chunks = build_stage_modules(tiny().replace(tie_embeddings=True), None, v=2, seed=5)
    zero = ZeroOptimizer(
        torch.nn.ModuleList(chunks),
        None,
        stage=2,
        optimizer=HOST_ADAMW,
        offload=OffloadOptions(pin_memory=False),
    )
    with pytest.raises(RuntimeError, match="final_at_step=True"):
        settle_landings(zero)
    zero.close()
