"""ZeRO stage 3 specifics (prefetch, pytree (dict) outputs, single-process runs) and the
single-process unit tests of the loss scaler, the norm helpers and construction errors.

Shares the model, reference and cached distributed suite of ``tests/zero_cases.py`` (see its docstring
for the parity contract: 1e-6 relative after 5 AdamW steps).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.zero import LossScaleError, LossScaler, ZeroOptimizer, clip_coefficient, global_grad_norm
from zero_cases import (
    MICRO_BS,
    STEPS,
    TinyLM,
    assert_weights,
    build,
    full_weights,
    make_model,
    ok,
    parity_cfgs,
    reference,
    suite,
    train,
)


def test_stage3_prefetches_after_recording_the_order():
    """Forward and, where units are released after forward, backward too (inside backward: the blocks'
    configs bound the prefetch below one block, so the forward's end takes only the first of the backward
    order): also when blocks are recomputed inside backward by reentrant checkpointing, whose recomputation
    gathers each unit before its output hooks fire (counting the backward order only from those hooks,
    nothing was prefetched in backward)."""
    for i, cfg in enumerate(parity_cfgs(2)):
        if cfg["stage"] == 3 and cfg.get("prefetch", 0) >= 600:
            for r in ok([r["parity"][i] for r in suite(2)]):
                assert r["stats"]["prefetched"] > 0, cfg
                if cfg.get("units") == "blocks" and cfg.get("reshard", True):
                    assert r["stats"]["prefetched_in_backward"] > 0, cfg


def test_reshard_after_forward_frees_what_autograd_saved():
    """dp=2, units = blocks: eager autograd saves views of the gathered weights (``weight.t()``), so releasing a
    unit must free the buffer's storage, not only point the parameters elsewhere. When the forward ends, the
    storages autograd holds for backward are smaller by exactly the blocks' gathered segments with resharding
    (FSDP2's ``reshard_after_forward``) than without; both train to the same weights. Replacing each gathered
    buffer with a new one instead of freeing its storage (the old scheme) held both amounts equal."""
    per_rank = [ok([r["saved_bytes"][flag] for r in suite(2)]) for flag in (True, False)]
    for on, off in zip(*per_rank):
        assert on["blocks"] > 0
        assert off["held"] - on["held"] == on["blocks"], (on["held"], off["held"], on["blocks"])
        assert_weights(on["module"], off["module"], "reshard_after_forward on/off", 0.0)


def test_any_module_single_process_stage3_matches_reference():
    """dp_group=None runs without torch.distributed; stage 3 with persistence on a plain model."""
    cfg = dict(stage=3, gas=3, persist=50, prefetch=10_000)
    model = make_model()
    opt = build(model, cfg, None)
    train(model, opt, cfg, STEPS)
    assert_weights(full_weights(model, opt), reference(3 * MICRO_BS)[0], "single process stage 3")


class DictBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return {"hidden": self.block(x), "aux": None}


class Boxed:
    """An output pytree does not look into: the unit's tensor cannot carry the re-gather hook."""

    def __init__(self, hidden):
        self.hidden = hidden


class BoxBlock(DictBlock):
    def forward(self, x):
        return Boxed(self.block(x))


@pytest.mark.parametrize(
    "wrapper,unwrap",
    [(DictBlock, lambda out: out["hidden"]), (BoxBlock, lambda out: out.hidden)],
    ids=["dict", "object"],
)
def test_units_with_container_outputs_train_as_the_reference(wrapper, unwrap):
    """Units returning dicts: the backward re-gather hooks sit on the tensors inside. Units returning an object
    pytree cannot flatten: releasing them after forward would free what autograd saved for their backward with
    nothing to gather it again (garbage or a crash), so they stay gathered until their gradients are in."""
    torch.manual_seed(0)
    model = TinyLM()
    model.blocks = nn.ModuleList([wrapper(b) for b in model.blocks])

    def forward(ids, targets):
        x = model.embed(ids) + model.pos[: ids.shape[1]]
        for block in model.blocks:
            x = unwrap(block(x))
        return F.cross_entropy(model.head(model.norm(x)).float().flatten(0, 1), targets.flatten())

    model.forward = forward
    cfg = {"stage": 3, "units": "blocks", "gas": 1}
    opt = build(model, cfg, None)
    assert [u.name for u in opt.units] == ["<root>", "blocks.0", "blocks.1"]
    train(model, opt, cfg, STEPS)
    want = {n.replace(".block.", "."): w for n, w in full_weights(model, opt).items()}
    assert_weights(want, reference(MICRO_BS)[0], f"{wrapper.__name__}-output units")


# ---- single-process unit tests ------------------------------------------------------------------------
def test_loss_scaler_follows_deepspeed_semantics():
    s = LossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2)
    trace = []
    for overflow in [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0]:
        s.update(bool(overflow))
        trace.append(s.scale)
    # 3 clean steps double; first overflow uses up hysteresis, later ones halve until the scale grows again
    assert trace == [16, 16, 32, 32, 16, 8, 8, 8, 16, 16, 16]
    static = LossScaler(loss_scale=128.0)
    static.update(True)
    assert static.scale == 128.0 and static.overflows == 1


def test_loss_scaler_at_minimum_names_the_numbers():
    s = LossScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    s.update(True)
    assert s.scale == 1.0
    with pytest.raises(LossScaleError, match=r"minimum loss scale 1 \(min_loss_scale=1.*bf16"):
        s.update(True)


def test_clip_coefficient_matches_torch():
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6))
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(10.0, 0.0) == 1.0
    g = [torch.randn(3, 4), torch.randn(5)]
    want = float(torch.cat([t.flatten() for t in g]).norm())
    assert float(global_grad_norm([(t, True) for t in g])) == pytest.approx(want)


def test_construction_errors_name_the_problem():
    model = make_model()
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3, got 4"):
        ZeroOptimizer(model, stage=4)
    with pytest.raises(ValueError, match="in no param group"):
        ZeroOptimizer(model, param_groups=[{"params": [model.pos]}])
    with pytest.raises(ValueError, match="not submodules"):
        ZeroOptimizer(model, stage=3, units=[nn.Linear(2, 2)])
