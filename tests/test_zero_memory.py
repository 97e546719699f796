"""Per-rank bytes held by ZeroOptimizer at dp=4 (bf16 weights, AdamW) equal the memory estimator's
numbers with plait's accounting (fp32 gradient partitions), up to flat-buffer padding (at most dp-1
elements per segment), for ZeRO stages 1-3."""

import torch
import torch.distributed as dist
from torch import nn

from plait.testing import run_distributed
from plait.zero import CommOptions, PrecisionOptions, ZeroOptimizer
from plait.zero.memory import estimate_model_state_memory


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(257, 48),
        nn.Linear(48, 96),
        nn.GELU(),
        nn.Linear(96, 48),
        nn.LayerNorm(48),
        nn.Linear(48, 257),
    )


def memory_body(stage):
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    opt = ZeroOptimizer(
        model,
        dist.new_group(list(range(dist.get_world_size()))),
        stage=stage,
        precision=PrecisionOptions(param_dtype=torch.bfloat16),
        comm=CommOptions(reduce_bucket_size=4000, param_persistence_threshold=0),
        units=[model[0], model[1], model[3], model[4], model[5]],
    )
    ids = torch.randint(0, 257, (4, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):  # a step creates the optimizer state; then one more backward
        opt.backward(model(ids).float().square().mean())
        if _ == 0:
            opt.step()
    held = opt.memory_bytes()
    # the fp32 grad shards exist from the first reduction into them (stage 1: at the step) to the end of
    # the step: read them when the optimizer applies the update
    apply, at_step = opt.stepper.apply, {}
    opt.stepper.apply = lambda coef: at_step.update(opt.memory_bytes()) or apply(coef)
    opt.step()
    held["grad_shards"] = max(held["grad_shards"], at_step["grad_shards"])
    assert opt.memory_bytes()["grad_shards"] == 0  # given back after the step
    segments = sum(len(g.segments) for g in opt.groups)
    return numel, segments, held


def test_held_bytes_equal_the_estimator():
    for stage in (1, 2, 3):
        for numel, segments, held in run_distributed(memory_body, 4, stage):
            est = estimate_model_state_memory(numel, 4, stage, accounting="plait").gpu
            slack = 3 * segments * 16  # padding: < dp elements per segment, <= 16 bytes each
            assert abs(held["params"] - est.params) <= slack, (stage, held, est)
            assert abs(held["grads"] + held["grad_shards"] - est.grads) <= slack, (stage, held, est)
            assert abs(held["master"] + held["optimizer_state"] - est.optimizer_states) <= slack, (
                stage,
                held,
                est,
            )
