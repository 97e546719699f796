"""Float8 training (ds_config ``fp8``; ``plait.precision.float8``) under torchao's CPU emulation.

Parity contract: plait's float8 layers against torchao's own ``Float8Linear`` holding the same whole weight.
* tp 1: the same torchao autograd function on the same operands: outputs and gradients equal bit for bit.
* tp 2, with and without sequence parallelism (2 gloo ranks), float32: every sharded operand is scaled by the
  amax of the whole tensor (all-reduced over tp), so every float8 rounding equals torchao's at tp 1. What the
  shards then compute without a tp sum (column output and weight grad, row input and weight grad) is equal bit
  for bit; what sums partial results over tp (column input grad, row output, row bias grad under sequence
  parallelism) differs by float32 summation order only: two partial sums added in another order, within a few
  float32 ulps, so 1e-6 relative (``helpers.rel_err``, l2). The broken variant -- each shard scaled by its own
  amax -- rounds most elements differently (errors ~3e-2, e4m3 keeps 3 mantissa bits) and fails that bound.

The fp8 section, the conversion of whole models and the engine: tests/test_float8_training.py.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchao.float8.float8_linear import Float8Linear

from plait.layers.linear import ColumnParallelLinear, RowParallelLinear
from plait.parallel import ParallelMesh
from plait.precision.float8 import torchao_config
from plait.precision.float8_layers import Float8ColumnParallelLinear, Float8RowParallelLinear
from plait.testing import run_distributed
from helpers import rel_err

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
SUM_ORDER = 1e-6  # float32 summation order of the tp partial sums (module docstring)


def reference(weight: torch.Tensor, bias: torch.Tensor, config) -> Float8Linear:
    """torchao's ``Float8Linear`` holding copies of the whole ``weight`` ``[out, in]`` and ``bias``."""
    lin = nn.Linear(weight.shape[1], weight.shape[0])
    lin.weight.data.copy_(weight)
    lin.bias.data.copy_(bias)
    return Float8Linear.from_float(lin, config=config)


def run_both(layer, ref, x, grad, x_ref=None, grad_ref=None):
    """Forward and backward of ``layer`` on ``x`` and ``ref`` on ``x_ref``; returns (y, dx, y_ref, dx_ref)."""
    x = x.clone().requires_grad_()
    xr = (x if x_ref is None else x_ref).detach().clone().requires_grad_()
    y, yr = layer(x), ref(xr)
    y.backward(grad)
    yr.backward(grad if grad_ref is None else grad_ref)
    return y, x.grad, yr, xr.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_tp1_layers_equal_torchaos_float8_linear(recipe):
    cfg = torchao_config(recipe, emulate=True)
    g = torch.Generator().manual_seed(0)
    col = ColumnParallelLinear(64, (32, 16, 16), True, parts=("q_proj", "k_proj", "v_proj"))
    row = RowParallelLinear(64, 48, True)
    for layer, out in ((col, 64), (row, 48)):
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g))
        layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=g))
        ref = reference(layer.weight.data, layer.bias.data, cfg)
        cls = Float8ColumnParallelLinear if layer is col else Float8RowParallelLinear
        f8 = cls(layer, cfg)
        assert (
            f8.weight is layer.weight and f8.bias is layer.bias
        )  # the very parameters, not copies
        x, grad = torch.randn(2, 8, 64, generator=g), torch.randn(2, 8, out, generator=g)
        y, dx, yr, dxr = run_both(f8, ref, x, grad)
        for a, b in (
            (y, yr),
            (dx, dxr),
            (f8.weight.grad, ref.weight.grad),
            (f8.bias.grad, ref.bias.grad),
        ):
            assert torch.equal(a, b)
        assert (
            rel_err(y, torch.nn.functional.linear(x, layer.weight, layer.bias)) > 1e-3
        )  # float8 did round


def _tp2_errors() -> dict:
    """On 2 tp ranks: each float8 layer (and its per-shard-amax variant) against a whole-weight torchao
    ``Float8Linear``: relative errors of y, dx, dw, db of this rank's shard."""
    rank, group = dist.get_rank(), ParallelMesh(tp=2).tp_group
    cfg = torchao_config("tensorwise", emulate=True)
    g = torch.Generator().manual_seed(0)
    w1, b1, w2, b2 = (torch.randn(s, generator=g) for s in ((64, 32), (64,), (32, 64), (32,)))
    x1, x2, gy1, gy2 = (
        torch.randn(s, generator=g) for s in ((2, 8, 32), (2, 8, 64), (2, 8, 64), (2, 8, 32))
    )
    out = {}
    for sp in (False, True):
        seq = (lambda t: t.chunk(2, 1)[rank]) if sp else (lambda t: t)
        for broken in (False, True):
            kw = {"amax_group": None} if broken else {}
            col = ColumnParallelLinear(32, 64, True, group=group, sequence_parallel=sp)
            col.weight.data.copy_(w1.chunk(2)[rank])
            col.bias.data.copy_(b1.chunk(2)[rank])
            f8, ref = Float8ColumnParallelLinear(col, cfg, **kw), reference(w1, b1, cfg)
            y, dx, yr, dxr = run_both(f8, ref, seq(x1), gy1.chunk(2, -1)[rank], x1, gy1)
            out["column", sp, broken] = dict(
                y=rel_err(y, yr.chunk(2, -1)[rank]),
                dx=rel_err(dx, seq(dxr)),
                dw=rel_err(f8.weight.grad, ref.weight.grad.chunk(2)[rank]),
                db=rel_err(f8.bias.grad, ref.bias.grad.chunk(2)[rank]),
            )
            row = RowParallelLinear(64, 32, True, group=group, sequence_parallel=sp)
            row.weight.data.copy_(w2.chunk(2, 1)[rank])
            row.bias.data.copy_(b2)
            f8, ref = Float8RowParallelLinear(row, cfg, **kw), reference(w2, b2, cfg)
            y, dx, yr, dxr = run_both(f8, ref, x2.chunk(2, -1)[rank], seq(gy2), x2, gy2)
            out["row", sp, broken] = dict(
                y=rel_err(y, seq(yr)),
                dx=rel_err(dx, dxr.chunk(2, -1)[rank]),
                dw=rel_err(f8.weight.grad, ref.weight.grad.chunk(2, 1)[rank]),
                db=rel_err(f8.bias.grad, ref.bias.grad),
            )
    return out


@pytest.fixture(scope="module")
def tp2_errors():
    per_rank = run_distributed(_tp2_errors, 2)
    return {
        key: {q: max(r[key][q] for r in per_rank) for q in per_rank[0][key]} for key in per_rank[0]
    }


#: the quantities that sum partial results over tp (the others have no tp sum: equal bit for bit)
SUMMED = {
    ("column", False): {"dx"},
    ("column", True): {"dx"},
    ("row", False): {"y"},
    ("row", True): {"y", "db"},
}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sequence-parallel"])
@pytest.mark.parametrize("layer", ["column", "row"])
def test_tp2_layers_match_torchaos_float8_linear(tp2_errors, layer, sp):
    errors = tp2_errors[layer, sp, False]
    for quantity, err in errors.items():
        bound = SUM_ORDER if quantity in SUMMED[layer, sp] else 0.0
        assert err <= bound, f"{layer} {quantity}: {err:.3g} > {bound}"


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sequence-parallel"])
@pytest.mark.parametrize("layer", ["column", "row"])
def test_a_per_shard_amax_fails_the_parity_bound(tp2_errors, layer, sp):
    errors = tp2_errors[layer, sp, True]
    assert errors["y"] > 1e3 * SUM_ORDER and errors["dw"] > 1e3 * SUM_ORDER, errors
