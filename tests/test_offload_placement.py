"""GPU-first placement of ZeRO-Offload's optimizer states (``plait.zero.offload.placement``,
``offload_optimizer.ratio``): the plan, the states on the side it names, resume across placements, refusals.

The placement's parity with the all-host and non-offloaded steps (bit for bit, dp 1 and 2, stages 2-3, bf16)
is tests/test_offload.py's (its ``ratio`` cases); on a GPU tests/gpu/run_offload_gpu.py runs them and checks
that each resident master and moment is in device memory and every other one in host memory.
"""

import math
import os

import pytest
import torch

from plait.config import ConfigError, load_config
from plait.zero.offload import OffloadOptions
from plait.zero.offload.placement import resident_params
from offload_helpers import ds_config, train

STEPS = 5


@pytest.mark.parametrize(
    "ratio,resident",
    [(1.0, []), (0.75, []), (0.7, [0]), (0.5, [0, 1]), (0.3, [0, 1, 2]), (0.0, [0, 1, 2, 3])],
)
def test_the_plan_keeps_the_forward_first_blocks_within_the_device_share(ratio, resident):
    """Blocks of 30, 20, 10, 40 elements: the leading blocks whose sum stays within (1 - ratio) x 100."""
    blocks = [[torch.zeros(n)] for n in (30, 20, 10, 40)]
    assert resident_params(blocks, ratio) == {id(blocks[i][0]) for i in resident}


def test_the_engine_places_the_planned_share_and_trains_as_the_all_host_run():
    """Stage 2, ratio 0.5: the resident groups hold the forward-first parameters, at most half of the elements
    and more than half minus the largest parameter; losses and weights equal the all-host run bit for bit."""
    host = train(ds_config(2, offload=True, gas=1), STEPS)
    half = train(ds_config(2, offload=True, gas=1, ratio=0.5), STEPS)
    total = sum(n for _, n, *_ in half["placed"])
    resident = sum(n for on_device, n, *_ in half["placed"] if on_device)
    largest = max(w.numel() for w in half["weights"].values())
    assert 0.5 * total - largest < resident <= 0.5 * total
    assert not any(on_device for on_device, *_ in host["placed"])
    assert half["losses"] == host["losses"] and half["steps"] == host["steps"] == STEPS
    for name, w in host["weights"].items():
        assert torch.equal(half["weights"][name], w), name


@pytest.mark.parametrize("first,second", [(0.5, 1.0), (1.0, 0.0), (0.5, 0.2)])
def test_a_checkpoint_resumes_in_another_placement_exactly(first, second, tmp_path):
    """3 steps at one ratio, saved, 2 more at another: the states are stored per logical parameter whatever
    their side, so the resumed steps equal the uninterrupted run's bit for bit."""
    whole = train(ds_config(3, offload=True, gas=1, ratio=first), STEPS)
    path = os.path.join(tmp_path, "ckpt")
    train(ds_config(3, offload=True, gas=1, ratio=first), 3, save=path)
    resumed = train(ds_config(3, offload=True, gas=1, ratio=second), 2, start=3, load=path)
    assert resumed["losses"] == whole["losses"][3:] and resumed["steps"] == STEPS
    for name, w in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


def test_a_placement_the_step_cannot_serve_is_refused_naming_the_ratio():
    with pytest.raises(
        ValueError,
        match=r"offload_optimizer.ratio=0.5 .*offload_param \(the weights of a resident "
        r"group must live on the device\); set the ratio to 1",
    ):
        train(ds_config(3, offload=True, param=True, ratio=0.5), 1)
    with pytest.raises(
        ValueError, match=r"device_step_fraction 0.5 needs gradient_accumulation_steps=1 \(got 2\)"
    ):
        train(ds_config(2, offload=True, gas=2, ratio=0.5, device_step=0.5), 1)
    for bad in (1.5, -0.1, math.nan, "half", True):
        with pytest.raises(
            ConfigError,
            match=r"offload_optimizer\.ratio'? (= \S+ )?(is out of range: it )?must be a",
        ):
            load_config(ds_config(2, offload=True, ratio=bad), dp_size=1)
    with pytest.raises(
        ConfigError, match="offload_param.ratio = 0.5 is not a key of offload_param"
    ):
        load_config(
            {
                **ds_config(3),
                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "ratio": 0.5}},
            },
            dp_size=1,
        )
    with pytest.raises(ValueError, match=r"offload ratio=2 must be a number in \[0, 1\]"):
        OffloadOptions(ratio=2)
