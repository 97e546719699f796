"""``HostOptimizer`` (the offloaded CPU Adam) against ``torch.optim.AdamW`` in one process: the same steps to
float32 rounding (rtol 1e-6: the numba kernel and torch order the element arithmetic differently; the per-step
agreement of the kernels themselves is tests/test_kernels.py's), a torch-shaped state, and a state dict that
round-trips between the two."""

import torch

from plait.zero.offload import HostOptimizer


def test_host_optimizer_state_is_torch_shaped_and_round_trips():
    m = torch.nn.Parameter(torch.randn(100))
    opt = HostOptimizer([m], kind="adamw", lr=1e-2, weight_decay=0.1)
    ref_p = torch.nn.Parameter(m.detach().clone())
    ref = torch.optim.AdamW([ref_p], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(100)
        m.grad, ref_p.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.allclose(m, ref_p, rtol=1e-6, atol=1e-7)
    assert sorted(opt.state[m]) == sorted(ref.state[ref_p]) and float(opt.state[m]["step"]) == 3
    fresh = HostOptimizer(
        [torch.nn.Parameter(m.detach().clone())], kind="adamw", lr=1e-2, weight_decay=0.1
    )
    fresh.load_state_dict(ref.state_dict())
    p2 = fresh.param_groups[0]["params"][0]
    g = torch.randn(100)
    p2.grad, ref_p.grad = g.clone(), g.clone()
    fresh.step()
    ref.step()
    assert fresh.kernels[p2].step_count == 4
    assert torch.allclose(p2, ref_p, rtol=1e-6, atol=1e-7)
