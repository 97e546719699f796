"""``plait.hf.config_fill`` fills every "auto" value as the installed transformers does.

The reference is transformers' own code: ``HfTrainerDeepSpeedConfig.trainer_config_process`` and
``trainer_config_finalize``, run on accelerate's ``HfDeepSpeedConfig`` (transformers' class refuses to start
without the deepspeed package, which its fill code never calls). Each real ds_config in tests/data and one
config with every fillable key "auto" are filled by both under several ``TrainingArguments``; each key the
reference filled must hold the same value in plait's fill (exact equality: both compute the same Python
numbers), and a config the reference refuses as disagreeing with the arguments plait refuses too. Dropping
``max(1, ...)`` from plait's warm-up fill fails the default-argument rows.

One difference by design: transformers before 4.57 filled ``warmup_num_steps`` with 0 under the default
arguments and left it to DeepSpeed (whose WarmupLR then ran max(2, n) steps; DeepSpeed >= 0.19.6 refuses 0);
plait fills max(1, n) as today's transformers does, so the reference's warm-up is read as max(1, n).
"""

import copy
import dataclasses
import json
import types
from pathlib import Path

import pytest
from accelerate.utils.deepspeed import HfDeepSpeedConfig
from transformers import TrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from plait.config import ConfigError, load_config
from plait.hf.config_fill import fill_from_args, hf_hidden_size, say_filled

CONFIGS = sorted((Path(__file__).parent / "data" / "ds_configs").glob("*.json"))
EVERY_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}
# transformers 5 reads a warmup_steps below 1 as the ratio (and dropped warmup_ratio); 4.x has warmup_ratio
WARMUP_RATIO = (
    "warmup_ratio"
    if "warmup_ratio" in {f.name for f in dataclasses.fields(TrainingArguments)}
    else "warmup_steps"
)
ARGS = {  # the Trainer's defaults first: what every user who writes no warm-up runs
    "defaults": {},
    "warmup-steps": {
        "warmup_steps": 3,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
    },
    "warmup-ratio": {
        WARMUP_RATIO: 0.25,
        "learning_rate": 3e-4,
        "weight_decay": 0.1,
        "max_grad_norm": 0.5,
        "adam_beta1": 0.8,
        "adam_epsilon": 1e-6,
    },
    "bf16": {"bf16": True, "warmup_steps": 5},
}
MAX_STEPS = 40


def transformers_fill(config: dict, args, model, max_steps: int) -> dict:
    """transformers' own fill of ``config`` (both stages, as the Trainer runs them)."""
    methods = (
        "fill_match",
        "fill_only",
        "is_auto",
        "trainer_config_process",
        "trainer_config_finalize",
    )
    Reference = type(
        "Reference",
        (HfDeepSpeedConfig,),
        {m: HfTrainerDeepSpeedConfig.__dict__[m] for m in methods},
    )
    reference = Reference(copy.deepcopy(config))
    reference.mismatches, reference._dtype = [], None
    reference.trainer_config_process(args)
    reference.trainer_config_finalize(args, model, max_steps)
    params = reference.config.get("scheduler", {}).get("params", {})
    if (
        isinstance(params.get("warmup_num_steps"), int)
        and config["scheduler"]["params"]["warmup_num_steps"] == "auto"
    ):
        params["warmup_num_steps"] = max(
            1, params["warmup_num_steps"]
        )  # transformers < 4.57 (docstring)
    return reference.config


def leaves(node, path=""):
    """{dotted path: value} of every leaf."""
    if isinstance(node, dict):
        return {
            k: v
            for key, sub in node.items()
            for k, v in leaves(sub, f"{path}.{key}" if path else key).items()
        }
    return {path: node}


def hf_model(**config):
    return types.SimpleNamespace(config=types.SimpleNamespace(**config))


@pytest.mark.parametrize("args_name", list(ARGS))
@pytest.mark.parametrize(
    "config_path", [None, *CONFIGS], ids=lambda p: "every-auto" if p is None else p.stem
)
def test_every_auto_key_is_filled_as_transformers_fills_it(config_path, args_name, tmp_path):
    config = EVERY_AUTO if config_path is None else json.loads(config_path.read_text())
    if "bfloat16" in config:  # transformers reads only "bf16"; plait renames the old spelling first
        config = {("bf16" if k == "bfloat16" else k): v for k, v in config.items()}
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, **ARGS[args_name]
    )
    model = hf_model(hidden_size=48)
    try:
        expected = transformers_fill(config, args, model, MAX_STEPS)
    except ValueError as refused:  # a value that is not "auto" disagrees with the arguments
        assert "mismatch" in str(refused)
        with pytest.raises(ConfigError, match="disagree"):
            fill_from_args(
                config, args, dp=1, max_steps=MAX_STEPS, hidden_size=hf_hidden_size(model)
            )
        return
    ours = leaves(
        fill_from_args(config, args, dp=1, max_steps=MAX_STEPS, hidden_size=hf_hidden_size(model))
    )
    filled = {
        k: v for k, v in leaves(expected).items() if leaves(config).get(k) == "auto" and v != "auto"
    }
    assert filled or "auto" not in json.dumps(config)
    assert {k: ours.get(k) for k in filled} == filled


def test_the_default_warmup_fills_a_positive_step_count_that_the_config_accepts(tmp_path):
    """The bug the seed configs hit: warmup_num_steps "auto" and TrainingArguments' default warmup_steps=0."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    filled = fill_from_args(EVERY_AUTO, args, dp=1, max_steps=MAX_STEPS, hidden_size=48)
    assert filled["scheduler"]["params"]["warmup_num_steps"] == 1
    cfg = load_config(filled, dp_size=1)
    assert (
        cfg.scheduler.params["warmup_num_steps"] == 1
        and cfg.scheduler.params["total_num_steps"] == MAX_STEPS
    )


@pytest.mark.parametrize(
    "config,expected",
    [
        ({"hidden_size": 32}, 32),
        ({"hidden_sizes": [8, 64, 16]}, 64),
        ({"text_config": types.SimpleNamespace(hidden_size=24)}, 24),
        ({"text_config": types.SimpleNamespace(hidden_sizes=[4, 40])}, 40),
        ({"vocab_size": 8}, None),
    ],
)
def test_the_hidden_size_is_found_where_transformers_finds_it(config, expected):
    assert hf_hidden_size(hf_model(**config)) == expected


def test_a_ddp_timeout_the_script_set_becomes_the_collective_timeouts(tmp_path):
    """The Trainer starts the group with ``ddp_timeout``; the engine must not replace a value the script wrote
    with its own 180 s (issue 41.6). The default, or a config that sets ``comm``, is left alone."""

    def comm(config, **kw):
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)
        return fill_from_args(config, args, dp=1, max_steps=MAX_STEPS).get("comm")

    assert comm(EVERY_AUTO, ddp_timeout=7200) == {"timeout_s": 7200.0, "startup_timeout_s": 7200.0}
    assert (
        load_config(
            fill_from_args(
                EVERY_AUTO,
                TrainingArguments(
                    output_dir=str(tmp_path), report_to=[], use_cpu=True, ddp_timeout=7200
                ),
                dp=1,
                max_steps=MAX_STEPS,
                hidden_size=48,
            ),
            dp_size=1,
        ).comm.timeout_s
        == 7200
    )
    assert comm(EVERY_AUTO) is None
    assert comm({**EVERY_AUTO, "comm": {"timeout_s": 60}}, ddp_timeout=7200) == {"timeout_s": 60}


def test_the_ddp_timeout_line_is_said_by_the_trainer_once_not_by_each_fill(tmp_path, caplog):
    """TRL's DPO fills a second config for its reference engine: filling logs nothing, the Trainer's one
    ``say_filled`` call says where the timeouts came from (before: the line came once per fill)."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, ddp_timeout=7200)
    with caplog.at_level("INFO", logger="plait"):
        filled = [fill_from_args(EVERY_AUTO, args, dp=1, max_steps=MAX_STEPS) for _ in range(2)]
        assert caplog.records == []
        say_filled(EVERY_AUTO, filled[0], args)
        say_filled(
            {**EVERY_AUTO, "comm": {"timeout_s": 60}},
            fill_from_args(
                {**EVERY_AUTO, "comm": {"timeout_s": 60}}, args, dp=1, max_steps=MAX_STEPS
            ),
            args,
        )
    assert [r.getMessage() for r in caplog.records] == [
        "comm timeouts: 7200 s from TrainingArguments.ddp_timeout"
    ]


def test_a_config_without_gradient_clipping_says_once_that_max_grad_norm_goes_unused(
    tmp_path, caplog
):
    """FastChat's configs have no gradient_clipping key: DeepSpeed clips nothing then, nor does plait, while the
    same script without a ds_config clips at max_grad_norm=1.0; the user is told, naming the key to add."""
    fastchat = json.loads(
        (
            Path(__file__).parent / "data" / "ds_configs" / "fastchat__deepspeed_config_s2.json"
        ).read_text()
    )
    assert "gradient_clipping" not in fastchat
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with caplog.at_level("WARNING", logger="plait.hf.config_fill"):
        filled = fill_from_args(fastchat, args, dp=1, max_steps=MAX_STEPS)
        say_filled(fastchat, filled, args)
        say_filled(
            EVERY_AUTO, fill_from_args(EVERY_AUTO, args, dp=1, max_steps=MAX_STEPS), args
        )  # "auto": clips
        say_filled(
            fastchat,
            filled,
            TrainingArguments(
                output_dir=str(tmp_path), report_to=[], use_cpu=True, max_grad_norm=0.0
            ),
        )  # asks for none
    assert "gradient_clipping" not in filled
    assert [r.getMessage() for r in caplog.records] == [
        "the ds_config has no gradient_clipping key: as under DeepSpeed, gradients are not clipped and "
        'TrainingArguments max_grad_norm=1.0 is not used; add "gradient_clipping": "auto" to the ds_config to '
        "clip at max_grad_norm"
    ]
