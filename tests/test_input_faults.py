"""Bad input is refused before it can spoil a run (CPU/gloo): config values out of range and a learning rate that
would be guessed name the key; out-of-range token ids and labels name the value, its position and the vocabulary,
on every rank of tp x pp x dp, and leave nothing of the failed step; malformed batches and short iterators name
what was expected."""

import math

import pytest
import torch

import plait
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.testing import run_distributed
from helpers import micro_batch, tiny
from faults_helpers import GAS, _good_step, _tp_pp_engine, ds_config


@pytest.mark.parametrize(
    "section,key,value,allowed",
    [
        ("optimizer", "lr", -1e-3, "a finite number >= 0"),
        ("optimizer", "lr", math.nan, "a finite number >= 0"),
        ("optimizer", "betas", [1.5, 0.9], "two numbers in [0, 1)"),
        ("optimizer", "eps", -1.0, "a finite number >= 0"),
        ("optimizer", "weight_decay", -0.1, "a finite number >= 0"),
        (None, "gradient_clipping", math.nan, "finite"),
    ],
)
def test_config_values_are_range_checked_naming_the_key(section, key, value, allowed):
    from plait.config import ConfigError, load_config

    cfg = {"train_micro_batch_size_per_gpu": 1}
    if section:
        cfg["optimizer"] = {"type": "AdamW", "params": {key: value}}
    else:
        cfg[key] = value
    with pytest.raises(ConfigError) as err:
        load_config(cfg, world_size=1)
    assert f"{'optimizer.params.' if section else ''}{key} = " in str(err.value) and allowed in str(
        err.value
    )


BAD_INPUTS = [
    ("input_ids", 5000, "input_ids[1, 3] = 5000"),
    ("input_ids", -7, "input_ids[1, 3] = -7"),
    ("input_ids", 257, "input_ids[1, 3] = 257"),
    ("labels", 260, "labels[1, 3] = 260"),
    ("labels", -5, "labels[1, 3] = -5"),
]


def _bad_input_body(tp, pp):
    """Every rank of tp x pp x dp meets the same bad micro-batch (pulled whole, checked before any rank computes)."""
    engine, mesh = _tp_pp_engine(tp, pp)
    messages = []
    for key, value, _ in BAD_INPUTS:
        batches = [
            {k: v.clone() for k, v in micro_batch(0, j, mesh.dp_rank).items()} for j in range(GAS)
        ]
        batches[1][key][1, 3] = value
        try:
            engine.train_batch(iter(batches))
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
        zero = engine.optimizer  # the failed step's accumulation was dropped
        leftovers = (
            zero.micro_steps
            + sum(p.grad is not None for p in zero.params)
            + sum(g.untyped_storage().nbytes() for g in zero.grad_shards)
        )  # given back: 0 bytes
        assert leftovers == 0, (key, value, leftovers)
    after = _good_step(
        engine, mesh
    )  # the bad steps left nothing: equals a fresh engine's first step
    return messages, engine.global_steps, after


def _good_step_body(tp, pp):
    return _good_step(*_tp_pp_engine(tp, pp))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_out_of_range_ids_and_labels_raise_naming_value_position_and_vocab(tp, pp):
    runs = run_distributed(_bad_input_body, 2, tp, pp, timeout_s=300)
    fresh = run_distributed(_good_step_body, 2, tp, pp, timeout_s=300)
    for (messages, steps, after), want in zip(runs, fresh):
        assert steps == 1  # only the good step was applied
        assert after.keys() == want.keys() and all(torch.equal(after[n], want[n]) for n in want)
        for (_, _, where), msg in zip(BAD_INPUTS, messages):
            assert msg is not None and where in msg and "vocab_size (257)" in msg, msg
            assert (
                "[0, 257) or -100 (ignored)" if where.startswith("labels") else "[0, 257). "
            ) in msg


def test_malformed_batches_and_short_iterators_name_what_was_expected():
    engine = plait.initialize(
        TransformerModel(tiny(), ParallelMesh(), seed=5), ds_config(1), mesh=ParallelMesh()
    )
    good = micro_batch(0, 0, 0)
    with pytest.raises(
        TypeError, match="input_ids must be an integer tensor of token ids .* got torch.float32"
    ):
        engine(input_ids=good["input_ids"].float(), labels=good["labels"])
    with pytest.raises(ValueError, match=r"input_ids is empty \(shape \[0, 16\]\)"):
        engine(input_ids=good["input_ids"][:0], labels=good["labels"][:0])
    with pytest.raises(
        ValueError, match="scalar mean loss, got \\[2, 16, 384\\].*put the labels in the batch"
    ):
        engine.backward(engine(input_ids=good["input_ids"]))
    with pytest.raises(ValueError, match="ran out after 1 of the 2 micro-batches of step 1"):
        engine.train_batch(iter([good]))
    assert engine.global_steps == 0


def test_a_learning_rate_is_never_guessed():
    from plait.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match="'optimizer.params.lr' is \"auto\" but nothing resolves it; pass lr="
    ):
        load_config(
            {
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            },
            world_size=1,
        )
    assert (
        load_config(
            {
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            },
            world_size=1,
            lr=2e-5,
        ).optimizer.params["lr"]
        == 2e-5
    )
    engine = plait.initialize(
        TransformerModel(tiny(), ParallelMesh(), seed=5),
        {"train_micro_batch_size_per_gpu": 1},
        mesh=ParallelMesh(),
    )  # no optimizer: forward only (tests/test_forward_only.py)
    with pytest.raises(ConfigError, match="built without an optimizer"):
        engine.step()
