"""Config fuzz: seeded random mutations of the real ds_configs in ``tests/data/ds_configs`` (those that load as
written). Each mutation deletes a key, sets a value to 0 / -1 / 1e30 / NaN / "auto" / a string / a list / null /
an object, renames a key with a typo, swaps a value's type, writes a boolean as text or nests garbage. Each
mutated config either loads, or is refused with a ``ConfigError`` whose message names the mutated key (its
dotted path or its last name; a deleted key may be named by its section, a misspelt one by its right name).
A seeded sample of the mutations is also handed to ``plait.initialize`` on a tiny model and trained one
optimizer step on CPU (except those that compile: inductor takes seconds; test_real_ds_configs trains them),
where the same holds: it trains, or is refused naming the key. Nothing else is raised and no case hangs
(``pytest.mark.timeout`` per case). When written: 600 mutations of 33 configs, 167 load (47 of them train),
433 are refused; about 15 s on one core.

Reproduce one case: ``mutate(i, bases)`` is a pure function of the index; the test id is the index.
"""

import copy
import json
import logging
import math
import random
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import plait
from helpers import micro_batch, tiny
from plait.config import ConfigError, load_config
from plait.layers import TransformerModel

CORPUS = Path(__file__).parent / "data" / "ds_configs"
SEED = 41
MUTATIONS = 600
TRAIN_SAMPLE = frozenset(random.Random(SEED).sample(range(MUTATIONS), 170))  # about 45 of them load
#: the Hugging Face Trainer's side, as in test_real_ds_configs: it fills every "auto"
FACTS = dict(
    micro_batch_size=2,
    gradient_accumulation_steps=1,
    mixed_precision="bf16",
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    gradient_clipping=1.0,
    warmup_min_lr=0.0,
    warmup_num_steps=2,
    total_num_steps=6,
    model_hidden_size=32,
)
VALUES = (0, -1, 1e30, math.nan, "auto", "garbage", [1, 2], None, {"garbage": 1})
GARBAGE = {"garbage": {"deeper": [1, None, {"x": "auto"}], "enabled": "maybe"}}
KINDS = ("delete", "value", "value", "value", "typo", "swap", "bool_text", "nest")


def configs_that_load():
    """name -> config, for the real configs that load unmodified (the others are refused by name already,
    tests/test_real_ds_configs.py)."""
    out = {}
    for path in sorted(CORPUS.glob("*.json")):
        config = json.loads(path.read_text())
        try:
            load_config(config, dp_size=1, **FACTS)
        except ConfigError:
            continue
        out[path.name] = config
    return out


@pytest.fixture(scope="module")
def bases():
    out = configs_that_load()
    assert len(out) >= 30
    return out


@pytest.fixture(scope="module")
def model():
    return TransformerModel(tiny(), None, seed=5)


def _key_paths(node, prefix=()):
    for key, value in node.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from _key_paths(value, prefix + (key,))


def _typo(key, rng):
    i = rng.randrange(len(key))
    options = {
        key[:i] + key[i + 1 :],
        key[:i] + key[i] + key[i:],
        key[:i] + key[i + 1 : i + 2] + key[i] + key[i + 2 :],
    }
    return rng.choice(sorted(options - {key, ""}) or [key + "x"])


def _swapped(value):
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return 1
    if isinstance(value, list):
        return {"0": value}
    return "null" if value is None else [value]


class Case(NamedTuple):
    name: str  # the base config's file
    config: dict  # mutated
    path: tuple  # the mutated key (after a typo: the misspelt one)
    kind: str
    written: object
    original: str  # the key's name before a typo

    def __str__(self):
        return f"{self.name}: {self.kind} {'.'.join(self.path)} -> {self.written!r}"


def mutate(index, bases) -> Case:
    """Case ``index``: a pure function of the index and the base configs."""
    rng = random.Random(f"{SEED}-{index}")
    name = rng.choice(sorted(bases))
    config = copy.deepcopy(bases[name])
    kind = rng.choice(KINDS)
    paths = list(_key_paths(config))
    flags = [p for p in paths if isinstance(_get(config, p), bool)]
    path = rng.choice(flags if kind == "bool_text" and flags else paths)
    parent, key = _get(config, path[:-1]), path[-1]
    old, original = parent[key], key
    if kind == "delete":
        del parent[key]
        written = None
    elif kind == "typo":
        written = _typo(key, rng)
        parent[written] = parent.pop(key)
        path = path[:-1] + (written,)
    elif kind == "nest" and isinstance(old, dict):
        written = old["garbage_key"] = GARBAGE
        path = path + ("garbage_key",)
    else:
        written = (
            {"value": old, **GARBAGE}
            if kind == "nest"
            else (rng.choice(VALUES) if kind == "value" else _swapped(old))
        )
        parent[key] = written
    return Case(name, config, path, kind, written, original)


def _get(config, path):
    node = config
    for key in path:
        node = node[key]
    return node


def _names_the_key(message, case):
    names = {".".join(case.path), case.path[-1]}
    if case.kind == "delete" and len(case.path) > 1:
        names.add(case.path[-2])  # a section that now lacks the key
    if case.kind == "typo":
        names.add(case.original)  # "did you mean '<the right name>'?"
    return any(n in message for n in names)


def _train_one_step(config, model):
    engine = plait.initialize(
        copy.deepcopy(model),
        config,
        **FACTS,
        optimizer=None if isinstance(config.get("optimizer"), dict) else torch.optim.AdamW,
    )
    losses = []
    for j in range(engine.gradient_accumulation_steps()):  # one optimizer step
        loss = engine(**micro_batch(0, j, 0, micro=2, seq=8))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", range(MUTATIONS))
def test_a_mutated_real_config_trains_or_is_refused_naming_the_key(index, bases, model, caplog):
    caplog.set_level(logging.ERROR, logger="plait")  # not the accepted-key notices of every case
    case = mutate(index, bases)
    try:
        cfg = load_config(case.config, dp_size=1, **FACTS)
        if (
            index in TRAIN_SAMPLE and not cfg.compile.on
        ):  # compiled: test_real_ds_configs (inductor: seconds)
            engine, losses = _train_one_step(case.config, model)
            assert engine.global_steps == 1 and all(map(math.isfinite, losses)), case
    except ConfigError as err:
        assert _names_the_key(str(err), case), f"{case}: the refusal names no key: {err}"
