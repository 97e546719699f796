"""Each tensor-parallel collective's forward and backward against its definition, on 2 gloo ranks."""

import torch
import torch.distributed as dist

from plait.parallel import collectives as C
from plait.testing import run_distributed


def collectives_body():
    r, w = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(w)))
    full = torch.arange(2 * 4 * 6, dtype=torch.float64).view(
        2, 4, 6
    )  # [b, s, h], same on every rank
    mine = full * (r + 1)  # differs per rank
    total = sum(full * (k + 1) for k in range(w))
    base = torch.linspace(-1, 1, full.numel(), dtype=torch.float64).view_as(full)
    ups = [base * (k + 2) for k in range(w)]  # rank k's upstream gradient
    up, up_total = ups[r], sum(ups)
    checks = {}

    def run(fn, x, grad):
        x = x.clone().requires_grad_()
        y = fn(x, g)
        y.backward(grad)
        return y.detach(), x.grad

    y, gx = run(C.copy_to_tp, mine, up)
    checks["copy"] = torch.equal(y, mine) and torch.allclose(gx, up_total)
    y, gx = run(C.reduce_from_tp, mine, up)
    checks["reduce"] = torch.allclose(y, total) and torch.equal(gx, up)
    y, gx = run(C.scatter_to_tp, full, up.chunk(w, -1)[r])
    checks["scatter"] = torch.equal(y, full.chunk(w, -1)[r]) and torch.equal(
        gx, torch.cat([ups[k].chunk(w, -1)[k] for k in range(w)], -1)
    )
    y, gx = run(C.gather_from_tp, full.chunk(w, -1)[r], up)
    checks["gather"] = torch.equal(y, full) and torch.equal(gx, up.chunk(w, -1)[r])
    y, gx = run(C.scatter_to_sp, full, up.chunk(w, 1)[r])
    expect = torch.cat([ups[k].chunk(w, 1)[k] for k in range(w)], 1)
    checks["scatter_sp"] = torch.equal(y, full.chunk(w, 1)[r]) and torch.allclose(gx, expect)
    y, gx = run(C.gather_from_sp, full.chunk(w, 1)[r], up)
    checks["gather_sp"] = torch.equal(y, full) and torch.allclose(gx, up_total.chunk(w, 1)[r])
    y, gx = run(C.reduce_scatter_to_sp, mine, up.chunk(w, 1)[r])
    checks["reduce_scatter_sp"] = torch.allclose(y, total.chunk(w, 1)[r]) and torch.allclose(
        gx, expect
    )
    return checks


def test_collective_pairs_forward_and_backward():
    for rank, checks in enumerate(run_distributed(collectives_body, 2)):
        failed = [k for k, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: wrong results for {failed}"


def test_group_none_is_identity():
    x = torch.randn(2, 4, 3, requires_grad=True)
    for fn in (
        C.copy_to_tp,
        C.reduce_from_tp,
        C.scatter_to_tp,
        C.gather_from_tp,
        C.scatter_to_sp,
        C.gather_from_sp,
        C.reduce_scatter_to_sp,
    ):
        assert fn(x, None) is x
