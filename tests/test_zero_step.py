"""The decisions of ``ZeroOptimizer.step`` and its option groups (``plait.zero.policy``, ``plait.zero.stepper``).

* ``PrecisionOptions`` / ``ClipOptions`` (and ``ZeroOptimizer`` given something else) refuse a bad value with a
  ``ValueError`` naming the value and the fix.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from plait.zero import ClipOptions, LossScaler, NormGroups, PrecisionOptions, ZeroOptimizer


@pytest.mark.parametrize("make,match", [
    (lambda: PrecisionOptions(param_dtype="fp8"), r"param_dtype='fp8'.*unknown dtype 'fp8'; use one of"),
    (lambda: PrecisionOptions(loss_scaler=128.0), r"loss_scaler=128.0\) must be a plait.zero.LossScaler.*LossScaler"),
    (lambda: PrecisionOptions(skip_nonfinite=1), r"skip_nonfinite=1\) must be True or False"),
    (lambda: ClipOptions(max_grad_norm=-1.0), r"max_grad_norm=-1.0\) must be a finite number >= 0; 0 or None"),
    (lambda: ClipOptions(max_grad_norm=math.nan), r"max_grad_norm=nan\) must be a finite number"),
    (lambda: ClipOptions(norm_groups=(None, None)), r"norm_groups=\(None, None\)\) must be a plait.zero.NormGroups"),
    (lambda: ClipOptions(norm_exclude=["w"]), r"norm_exclude=\['w'\]\) must be a collection of parameter ids"),
    (lambda: ZeroOptimizer(nn.Linear(2, 2), precision="bf16"), r"precision='bf16'\) must be a PrecisionOptions or "
                                                               r"None; pass precision=PrecisionOptions\(...\)"),
    (lambda: ZeroOptimizer(nn.Linear(2, 2), clip=1.0), r"clip=1.0\) must be a ClipOptions"),
])
def test_option_groups_refuse_bad_values_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_option_groups_normalise_their_values():
    assert PrecisionOptions("bf16").param_dtype == torch.bfloat16 and PrecisionOptions().param_dtype is None
    clip = ClipOptions(None, None, {3, 4})
    assert clip.max_grad_norm == 0.0 and clip.norm_groups == NormGroups() and clip.norm_exclude == frozenset({3, 4})
    scaler = LossScaler(initial_scale_power=4)
    opt = ZeroOptimizer(nn.Linear(2, 2), precision=PrecisionOptions("fp16", scaler))
    assert opt.scaler is scaler and opt.params[0].dtype == torch.float16
    assert ZeroOptimizer(nn.Linear(2, 2), precision=PrecisionOptions("fp16")).loss_scale == 2.0 ** 16  # dynamic
