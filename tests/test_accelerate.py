"""``plait.accelerate``: accelerate scripts that use DeepSpeed, with only their import line changed
(``tests/data/accelerate_script.py``: accelerate's ``nlp_example.py`` loop; with a ds_config that has an
optimizer, ``DummyOptim``/``DummyScheduler`` as accelerate's DeepSpeed-with-config-file example), on CPU
(gloo, ``ACCELERATE_USE_CPU`` as ``accelerate launch --cpu`` sets it) with a tiny BERT classifier, dropout on.

Parity: each run is compared with the same script on accelerate itself without DeepSpeed (``--plain``; DDP at
2 processes), every micro-batch's loss on every process over 10 optimizer steps, to 1e-6 (float32 everywhere;
the runs agree to 1.2e-7: ZeRO reduces the gradients in another order than DDP, and the offloaded optimizer
runs plait's host Adam). A resumed run (``save_state`` after epoch 0, ``load_state`` in a new launch) repeats
the uninterrupted run's losses exactly (0 difference: weights, Adam's moments, the schedule, the RNG states
and the data order all come back), and a run resumed one epoch early would differ by far more.
Before this package, the same script stopped in ``Accelerator(deepspeed_plugin=...)`` with
``ImportError: DeepSpeed is not installed`` (``test_accelerate_itself_needs_deepspeed``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest
import torch
import transformers
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader

from plait.accelerate import Accelerator, DeepSpeedPlugin, DummyOptim, DummyScheduler
from plait.config import ConfigError

DATA = Path(__file__).parent / "data"
SCRIPT = DATA / "accelerate_script.py"
Z3_OFFLOAD = (
    DATA / "ds_configs" / "llama-factory__ds_z3_offload_config.json"
)  # no optimizer: the script's AdamW
ACCEL_Z2 = DATA / "ds_configs" / "accelerate__ds_config_zero2.json"  # AdamW + WarmupLR: DummyOptim
ENV = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}


def run(out: Path, *args, procs: int = 1, launcher=None) -> dict:
    if launcher is None:
        launcher = (
            ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
            if procs > 1
            else []
        )
    done = subprocess.run(
        [sys.executable, *launcher, str(SCRIPT), str(out), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def largest_difference(a: dict, b: dict) -> float:
    assert len(a["losses"]) == len(b["losses"]) and len(a["losses"][0]) == len(b["losses"][0])
    return max(abs(x - y) for xs, ys in zip(a["losses"], b["losses"]) for x, y in zip(xs, ys))


@pytest.fixture(scope="module")
def nlp_runs(tmp_path_factory):
    """accelerate's nlp_example loop with a ZeRO-3 + offload config (all batch keys "auto", no optimizer):
    plain and plait at 1 and 2 processes; at 2 processes saved after epoch 0 and resumed from there."""
    tmp = tmp_path_factory.mktemp("nlp")
    out = {
        "plain1": run(tmp / "plain1", "--plain"),
        "plait1": run(tmp / "plait1", "--ds_config", Z3_OFFLOAD),
        "plain2": run(tmp / "plain2", "--plain", procs=2),
        "plait2": run(tmp / "plait2", "--ds_config", Z3_OFFLOAD, "--save_epoch", 0, procs=2),
    }
    out["resumed2"] = run(
        tmp / "resumed2",
        "--ds_config",
        Z3_OFFLOAD,
        "--resume",
        tmp / "plait2" / "epoch_0",
        "--start_epoch",
        1,
        procs=2,
    )
    return out


@pytest.mark.parametrize("procs", [1, 2])
def test_nlp_example_loop_equals_plain_accelerate(nlp_runs, procs):
    plain, ours = nlp_runs[f"plain{procs}"], nlp_runs[f"plait{procs}"]
    assert (
        len(ours["losses"]) == 20 and len(ours["losses"][0]) == procs
    )  # 10 steps x 2 micro-batches
    assert largest_difference(plain, ours) <= 1e-6
    assert ours["lrs"] == pytest.approx(
        plain["lrs"], abs=1e-12
    )  # the schedule stepped as accelerate does
    assert ours["grad_norms"] == pytest.approx(
        plain["grad_norms"], abs=1e-6
    )  # clip_grad_norm_'s return
    assert [e["seen"] for e in ours["eval"]] == [13, 13]  # gather_for_metrics drops the padding
    assert [e["loss"] for e in ours["eval"]] == pytest.approx(
        [e["loss"] for e in plain["eval"]], abs=1e-6
    )
    assert ours["checksum"] == pytest.approx(
        plain["checksum"], rel=1e-6
    )  # get_state_dict: ZeRO-3, gathered
    config = ours["ds_config"]  # "auto" filled as accelerate fills it
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
        config["train_batch_size"],
        config["gradient_clipping"],
    ) == (4, 2, 8 * procs, 1.0)
    assert [
        config["zero_optimization"][k]
        for k in (
            "reduce_bucket_size",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
        )
    ] == [32 * 32, 921, 320]


def test_save_state_load_state_resume_repeats_the_run(nlp_runs):
    full, resumed = nlp_runs["plait2"], nlp_runs["resumed2"]
    assert len(resumed["losses"]) == 10
    assert largest_difference({"losses": full["losses"][10:]}, resumed) == 0.0
    assert (
        resumed["lrs"] == full["lrs"][5:]
        and resumed["eval"] == full["eval"][1:]
        and min(resumed["lrs"][:4]) > 0
    )
    assert (
        max(abs(a[0] - b[0]) for a, b in zip(full["losses"][:10], resumed["losses"])) > 1e-3
    )  # not a no-op


@pytest.fixture(scope="module")
def config_file_runs(tmp_path_factory):
    """accelerate's DeepSpeed-with-config-file example style with accelerate's own ds_config_zero2.json
    (AdamW and WarmupLR from the config, gradient_accumulation_steps 1 in it, ZeRO-2 with the optimizer
    offloaded): 1 process by torchrun's way, 2 through ``python -m plait.accelerate.launch --use_deepspeed
    --deepspeed_config_file`` (the plugin comes from accelerate launch's environment)."""
    tmp = tmp_path_factory.mktemp("config_file")
    reference = ("--plain", "--gas", 1, "--warmup_lr_reference")
    launch = [
        "-m",
        "plait.accelerate.launch",
        "--use_deepspeed",
        "--deepspeed_config_file",
        str(ACCEL_Z2),
        "--num_processes",
        "2",
    ]
    return {
        "plain1": run(tmp / "plain1", *reference),
        "plait1": run(tmp / "plait1", "--ds_config", ACCEL_Z2),
        "plain2": run(tmp / "plain2", *reference, procs=2),
        "plait2": run(tmp / "plait2", launcher=launch),
    }


@pytest.mark.parametrize("procs", [1, 2])
def test_config_file_example_equals_plain_accelerate(config_file_runs, procs):
    plain, ours = config_file_runs[f"plain{procs}"], config_file_runs[f"plait{procs}"]
    assert (
        len(ours["losses"]) == 20 and len(ours["losses"][0]) == procs
    )  # the config's accumulation (1) wins
    assert largest_difference(plain, ours) <= 1e-6
    assert ours["lrs"][:3] == [0.0, 2e-3, 2e-3] and ours["gradient_accumulation_steps"] == 1
    config = ours["ds_config"]
    assert (
        config["optimizer"]["params"]["lr"] == 2e-3
        and config["optimizer"]["params"]["weight_decay"] == 0
    )
    assert config["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 2e-3,
        "warmup_num_steps": 1,
    }
    assert (config["train_batch_size"], config["zero_optimization"]["reduce_bucket_size"]) == (
        4 * procs,
        32 * 32,
    )
    assert (
        ours["mixed_precision"] == "no" and config["fp16"]["enabled"] is False
    )  # "auto" from accelerate's "no"


def test_accelerate_itself_needs_deepspeed(tmp_path):
    """What users met before: the same plugin on accelerate's Accelerator stops at construction."""
    with pytest.raises(ImportError, match="DeepSpeed is not installed"):
        accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(ACCEL_Z2)))
    AcceleratorState._reset_state(True)


# ---- refusals (one process, in this one) ----------------------------------------------------------------------
@pytest.fixture
def accelerator():
    yield Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(ACCEL_Z2)), cpu=True)
    AcceleratorState._reset_state(True)


def tiny_bert():
    return transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
        )
    )


def loader():
    return DataLoader([{"input_ids": torch.arange(8), "labels": torch.tensor(1)}] * 4, batch_size=2)


def test_a_torch_optimizer_beside_the_configs_optimizer_is_refused(accelerator):
    model = tiny_bert()
    with pytest.raises(
        ValueError, match="'optimizer' section and the script passes a torch optimizer.*DummyOptim"
    ):
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()), loader())


def test_auto_micro_batch_without_a_dataloader_is_refused(accelerator):
    model = tiny_bert()
    with pytest.raises(ValueError, match='train_micro_batch_size_per_gpu is "auto".*dataloader'):
        accelerator.prepare(model, DummyOptim(model.parameters()))


def test_what_the_engine_does_not_serve_is_refused_by_name(accelerator):
    model = tiny_bert()
    optimizer = DummyOptim(model.parameters(), lr=1e-3)
    model, _, data, _ = accelerator.prepare(model, optimizer, loader(), DummyScheduler(optimizer))
    assert accelerator.engine is model and accelerator.unwrap_model(model) is model.module
    with pytest.raises(
        ConfigError, match='max_norm=0.5.*gradient_clipping = 1.0.*"gradient_clipping": 0.5'
    ):
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
    with pytest.raises(ConfigError, match="clip_grad_value_"):
        accelerator.clip_grad_value_(model.parameters(), 0.1)
    loss = model(**next(iter(data))).loss
    with pytest.raises(ConfigError, match=r"backward\(retain_graph=...\)"):
        accelerator.backward(loss, retain_graph=True)
    with pytest.raises(ConfigError, match="one model per Accelerator"):
        accelerator.prepare(tiny_bert())


def test_a_dynamo_backend_compiles_the_engine():
    """accelerate's DeepSpeed path calls engine.compile(backend, kwargs) for ``dynamo_backend``."""
    try:
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(ACCEL_Z2)),
            cpu=True,
            dynamo_backend="eager",
        )
        model = tiny_bert()
        optimizer = DummyOptim(model.parameters(), lr=1e-3)
        model, _, _, _ = accelerator.prepare(model, optimizer, loader(), DummyScheduler(optimizer))
        assert model.is_compiled
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"deepspeed_plugins": {"a": None, "b": None}},
            r"one DeepSpeedPlugin; got 2 \(deepspeed_plugins=\['a', 'b'\]\)",
        ),
        (
            {
                "deepspeed_plugin": DeepSpeedPlugin(
                    hf_ds_config=str(ACCEL_Z2), transformer_moe_cls_names="BertLayer"
                )
            },
            "transformer_moe_cls_names",
        ),
    ],
)
def test_unserved_accelerator_arguments_are_refused(kwargs, match):
    try:
        with pytest.raises(ConfigError, match=match):
            Accelerator(cpu=True, **kwargs)
    finally:
        AcceleratorState._reset_state(True)


def test_the_launcher_starts_deepspeed_runs_only():
    from plait.accelerate.launch import main

    with pytest.raises(SystemExit, match="--use_deepspeed"):
        main([str(SCRIPT), "out"])
