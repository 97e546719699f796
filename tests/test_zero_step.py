"""The decisions of ``ZeroOptimizer.step`` and its option groups (``plait.zero.policy``, ``plait.zero.stepper``).

* ``PrecisionOptions`` / ``ClipOptions`` (and ``ZeroOptimizer`` given something else) refuse a bad value with a
  ``ValueError`` naming the value and the fix.
* A non-finite global gradient norm is decided once, in ``ZeroOptimizer.step``, for both steppers: skipped by
  default (``skip_nonfinite``); with ``skip_nonfinite=False`` and no loss scaler it is applied as is
  (coefficient 1: an inf norm gives no clip factor), on the device and under offload (deferred and early
  mode) alike. The device run steps with the CPU kernel the host uses (``HostOptimizer``), so the two are
  equal bit for bit, nan included; the inf element's weight becomes nan, the others take the unclipped
  update.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from plait.zero import ClipOptions, LossScaler, NormGroups, PrecisionOptions, ZeroOptimizer
from plait.zero.offload import HostOptimizer, OffloadOptions


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: PrecisionOptions(param_dtype="fp8"),
            r"param_dtype='fp8'.*unknown dtype 'fp8'; use one of",
        ),
        (
            lambda: PrecisionOptions(loss_scaler=128.0),
            r"loss_scaler=128.0\) must be a plait.zero.LossScaler.*LossScaler",
        ),
        (lambda: PrecisionOptions(skip_nonfinite=1), r"skip_nonfinite=1\) must be True or False"),
        (
            lambda: ClipOptions(max_grad_norm=-1.0),
            r"max_grad_norm=-1.0\) must be a finite number >= 0; 0 or None",
        ),
        (
            lambda: ClipOptions(max_grad_norm=math.nan),
            r"max_grad_norm=nan\) must be a finite number",
        ),
        (
            lambda: ClipOptions(norm_groups=(None, None)),
            r"norm_groups=\(None, None\)\) must be a plait.zero.NormGroups",
        ),
        (
            lambda: ClipOptions(norm_exclude=["w"]),
            r"norm_exclude=\['w'\]\) must be a collection of parameter ids",
        ),
        (
            lambda: ZeroOptimizer(nn.Linear(2, 2), precision="bf16"),
            r"precision='bf16'\) must be a PrecisionOptions or "
            r"None; pass precision=PrecisionOptions\(...\)",
        ),
        (lambda: ZeroOptimizer(nn.Linear(2, 2), clip=1.0), r"clip=1.0\) must be a ClipOptions"),
    ],
)
def test_option_groups_refuse_bad_values_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_option_groups_normalise_their_values():
    assert (
        PrecisionOptions("bf16").param_dtype == torch.bfloat16
        and PrecisionOptions().param_dtype is None
    )
    clip = ClipOptions(None, None, {3, 4})
    assert (
        clip.max_grad_norm == 0.0
        and clip.norm_groups == NormGroups()
        and clip.norm_exclude == frozenset({3, 4})
    )
    scaler = LossScaler(initial_scale_power=4)
    opt = ZeroOptimizer(nn.Linear(2, 2), precision=PrecisionOptions("fp16", scaler))
    assert opt.scaler is scaler and opt.params[0].dtype == torch.float16
    assert (
        ZeroOptimizer(nn.Linear(2, 2), precision=PrecisionOptions("fp16")).loss_scale == 2.0**16
    )  # dynamic


def _poisoned_step(offload: OffloadOptions | None, clip: float, skip: bool):
    """One step of a Linear(8, 4) whose weight gradient has one inf element. Returns (applied, norm, masters)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW if offload else functools.partial(HostOptimizer, kind="adamw")
    opt = ZeroOptimizer(
        model,
        None,
        stage=2,
        optimizer=optimizer,
        optimizer_kwargs={"lr": 1e-2},
        clip=ClipOptions(clip),
        precision=PrecisionOptions(skip_nonfinite=skip),
        offload=offload,
    )
    model.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), math.inf))
    opt.backward(model(torch.randn(3, 8)).square().mean())
    applied = opt.step()
    opt.synchronize()
    masters = torch.cat([m.detach().clone() for m in opt.masters])
    opt.close()
    return applied, opt.grad_norm, masters


OFFLOADS = {
    "device": None,
    "offload deferred": OffloadOptions(overlap_step=False, pin_memory=False),
    "offload overlapped": OffloadOptions(pin_memory=False),
}  # early mode (host steps in backward) at clip 0


@pytest.mark.parametrize("where", list(OFFLOADS))
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_an_inf_norm_without_the_guard_is_applied_as_is_on_every_path(where, clip):
    applied, norm, masters = _poisoned_step(OFFLOADS[where], clip, skip=False)
    assert applied and norm == math.inf
    assert 0 < int(masters.isnan().sum()) < masters.numel()  # the inf column's weights only
    if (where, clip) != ("device", 0.0):  # that one is the reference itself
        _, _, want = _poisoned_step(None, 0.0, skip=False)  # the device step, unclipped
        torch.testing.assert_close(masters, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("where", list(OFFLOADS))
def test_an_inf_norm_with_the_guard_is_skipped_on_every_path(where):
    applied, norm, masters = _poisoned_step(OFFLOADS[where], 1.0, skip=True)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    assert not applied and norm is None
    initial = torch.cat([model.bias.detach(), model.weight.detach().flatten()])
    assert torch.equal(masters.sort().values, initial.sort().values)


def _clipped_run(fused: bool, max_norm: float = 0.05):
    """Three steps (clipped: the norm is far above 0.05) of an MLP with torch AdamW. Returns the weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = ZeroOptimizer(
        model,
        None,
        stage=2,
        optimizer=functools.partial(torch.optim.AdamW, fused=fused),
        optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
        clip=ClipOptions(max_norm),
    )
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        opt.backward(model(torch.randn(5, 8, generator=g)).square().mean() * 50)
        assert opt.step() and opt.grad_norm > 0.05
        assert getattr(opt.optimizer, "grad_scale", None) is None  # the folded scale is taken back
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_fused_adamw_takes_the_clip_coefficient_inside_its_kernel():
    """torch's fused AdamW divides by ``grad_scale`` = 1 / coef in its kernel instead of a separate
    ``grad.mul_(coef)`` pass: the same weights as the foreach AdamW with the multiplied gradients, to 1e-6
    relative (one rounding of grad * coef against grad / (1 / coef): a few ulps, and Adam's update divides
    by sqrt(v), so the weights move by ~1e-7 relative). The unclipped run differs by far more."""
    from plait.zero.stepper import folds_grad_scale

    fused, plain = _clipped_run(True), _clipped_run(False)
    assert ((fused - plain).norm() / plain.norm()).item() < 1e-6
    assert ((_clipped_run(True, 0.0) - plain).norm() / plain.norm()).item() > 1e-4
    assert folds_grad_scale(torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True))
    assert not folds_grad_scale(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]))
