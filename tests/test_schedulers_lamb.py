"""DeepSpeed-style learning-rate schedules and the LAMB optimizer against their formulas."""

import math

import numpy as np
import pytest
import torch

from plait.optim.lamb import Lamb
from plait.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR


def _opt(lr=0.1, groups=1):
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr
    )


def _run(sched, steps):
    out = [sched.get_last_lr()[0]]
    for _ in range(steps):
        sched.step()
        out.append(sched.optimizer.param_groups[0]["lr"])
    return out


def test_warmup_lr_log_and_linear():
    lrs = _run(WarmupLR(_opt(), warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=10), 12)
    assert lrs[0] == 0.0  # before the first step: min lr
    assert lrs[1] == 0.0  # t = 0: log(1) = 0
    assert lrs[5] == pytest.approx(1e-3 * math.log(5) / math.log(10), rel=1e-12)
    assert lrs[11] == lrs[12] == 1e-3
    lin = _run(WarmupLR(_opt(), 1e-4, 1e-3, 4, warmup_type="linear"), 6)
    assert lin[1:] == pytest.approx(
        [1e-4, 1e-4 + 9e-4 / 4, 1e-4 + 9e-4 / 2, 1e-4 + 27e-4 / 4, 1e-3, 1e-3]
    )


def test_warmup_decay_lr_reaches_zero_at_total():
    lrs = _run(
        WarmupDecayLR(
            _opt(),
            total_num_steps=20,
            warmup_max_lr=2e-3,
            warmup_num_steps=10,
            warmup_type="linear",
        ),
        25,
    )
    assert lrs[11] == pytest.approx(2e-3)  # t = 10: decay starts at max
    assert lrs[16] == pytest.approx(2e-3 * (20 - 15) / 10)
    assert lrs[21] == 0.0 and lrs[25] == 0.0


def test_warmup_cosine_ratio():
    s = WarmupCosineLR(
        _opt(lr=0.5),
        total_num_steps=110,
        warmup_min_ratio=0.1,
        warmup_num_steps=10,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    lrs = _run(s, 120)
    assert lrs[1] == pytest.approx(0.5 * 0.1)
    assert lrs[6] == pytest.approx(0.5 * (0.1 + 0.5 * 0.9))
    progress = (60 - 10 + 1) / 100
    assert lrs[61] == pytest.approx(0.5 * (0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2))
    assert lrs[120] == pytest.approx(0.5 * 0.01)


def test_scheduler_state_round_trip_and_errors():
    a = WarmupLR(_opt(), 0.0, 1.0, 100)
    for _ in range(7):
        a.step()
    b = WarmupLR(_opt(), 0.0, 1.0, 100)
    b.load_state_dict(a.state_dict())
    assert b.get_last_lr() == a.get_last_lr() and a.state_dict() == {"last_batch_iteration": 6}
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        WarmupLR(_opt(), warmup_num_steps=0)
    with pytest.raises(ValueError, match="2 param groups"):
        WarmupLR(_opt(groups=2), warmup_min_lr=[0.0, 0.1, 0.2])


def _lamb_reference(ws, gs_per_step, lr, b1, b2, eps, wd, min_coeff=0.01, max_coeff=10.0):
    """Algorithm 2 of You et al. (2020), per tensor, in float64 numpy; trust ratio clamped as DeepSpeed."""
    ws = [w.astype(np.float64).copy() for w in ws]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for t, gs in enumerate(gs_per_step, start=1):
        for i, g in enumerate(gs):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            r = (ms[i] / (1 - b1**t)) / (np.sqrt(vs[i] / (1 - b2**t)) + eps) + wd * ws[i]
            wn, rn = np.linalg.norm(ws[i]), np.linalg.norm(r)
            trust = min(max(wn / rn, min_coeff), max_coeff) if wn > 0 and rn > 0 else 1.0
            ws[i] = ws[i] - lr * trust * r
    return ws


def test_lamb_matches_paper_formula_over_10_steps():
    rng = np.random.default_rng(0)
    shapes = [(16, 8), (8,), (3, 5, 2)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    init[1][:] = 0.0  # a zero tensor: trust ratio 1
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(10)]
    params = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in init]
    opt = Lamb(params, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = torch.from_numpy(g)
        opt.step()
    ref = _lamb_reference(init, grads, 0.01, 0.9, 0.999, 1e-6, 0.01)
    for p, r in zip(params, ref):
        np.testing.assert_allclose(p.detach().numpy(), r, rtol=1e-5, atol=1e-7)


def test_lamb_first_step_moves_each_tensor_by_lr_times_its_norm():
    w = torch.nn.Parameter(torch.randn(32, 4))
    before = w.detach().clone()
    w.grad = torch.randn(32, 4)
    Lamb([w], lr=0.05, weight_decay=0.0).step()
    assert (w.detach() - before).norm().item() == pytest.approx(
        0.05 * before.norm().item(), rel=1e-5
    )
