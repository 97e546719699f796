"""Offload settings that must be refused or kept apart, and the host masters kept out of forked workers.

* ``device_step_fraction: "auto"`` (the adaptive split) reaches ``OffloadOptions`` as "auto": it is the key's
  own value, not a placeholder, so neither the config resolver nor the Hugging Face Trainer's fill of
  "auto" values replaces it.
* ``device_step_adaptive: true`` is its deprecated spelling (a warning); with a ``device_step_fraction`` as
  well the config is refused naming both, not run with one dropped.
* A ``device_step_fraction`` that is neither a number in [0, 1) nor "auto" is a ``ValueError``.
* The fp32 master shards on the host are ``MADV_DONTFORK`` like the other host buffers: a forked child
  reading them dies with SIGSEGV (``plait.kernels.host_memory``), so a DataLoader worker never makes the
  next host step copy them page by page.
* An engine dropped without ``close()`` frees its optimizer and the offload worker thread (the gradient hooks,
  held by C++ autograd nodes, reach the optimizer only weakly).
"""

import faulthandler
import functools
import gc
import threading
import time
import weakref
import multiprocessing as mp
import os
import signal
import sys

import pytest
import torch

import plait
from plait.config import ConfigError, load_config
from plait.hf import Trainer, TrainingArguments
from plait.hf.config_fill import fill_from_args
from plait.zero import CommOptions, ZeroOptimizer, weight_decay_groups
from plait.zero.offload import HostOptimizer, OffloadOptions


def offload_config(**offload) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", **offload}},
    }


def _adaptive(engine) -> bool:
    share = engine.optimizer.stepper.share
    return (
        engine.optimizer.offload_options.device_step_fraction == "auto"
        and share is not None
        and share.adaptive
    )


def test_device_step_fraction_auto_reaches_the_offload_options():
    cfg = load_config(offload_config(device_step_fraction="auto"), dp_size=1)
    assert cfg.zero_optimization.offload_optimizer.device_step_fraction == "auto"
    assert load_config(cfg.to_dict(), dp_size=1) == cfg
    engine = plait.initialize(torch.nn.Linear(4, 4), offload_config(device_step_fraction="auto"))
    assert _adaptive(engine)
    engine.optimizer.close()


def test_the_trainer_fill_keeps_device_step_fraction_auto(tmp_path):
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "device_step_fraction": "auto"},
        },
    }
    args = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed=config,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_steps=1,
        report_to=[],
        use_cpu=True,
    )
    filled = fill_from_args(config, args, dp=1, max_steps=1)
    assert filled["zero_optimization"]["offload_optimizer"]["device_step_fraction"] == "auto"
    assert (
        filled["gradient_clipping"] == 1.0 and filled["optimizer"]["params"]["lr"] == 1e-3
    )  # the real "auto"s
    trainer = Trainer(model=torch.nn.Sequential(torch.nn.Linear(4, 4)), args=args)
    assert _adaptive(trainer._build_engine(1))
    trainer.engine.optimizer.close()


def test_device_step_adaptive_is_a_deprecated_spelling_of_auto(caplog):
    with caplog.at_level("WARNING", logger="plait"):
        engine = plait.initialize(torch.nn.Linear(4, 4), offload_config(device_step_adaptive=True))
    assert 'device_step_adaptive is deprecated; write "device_step_fraction": "auto"' in caplog.text
    assert _adaptive(engine)
    engine.optimizer.close()


@pytest.mark.parametrize("fraction", [1.0, -0.1, "half", True])
def test_a_config_fraction_outside_the_range_is_refused(fraction):
    with pytest.raises(ConfigError, match="device_step_fraction"):
        load_config(offload_config(device_step_fraction=fraction), dp_size=1)


def test_adaptive_with_a_fraction_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"device_step_adaptive .* device_step_fraction=0.3"):
        plait.initialize(
            torch.nn.Linear(4, 4),
            offload_config(device_step_fraction=0.3, device_step_adaptive=True),
        )


@pytest.mark.parametrize("fraction", ["0.3", 1.0, -0.1, True])
def test_a_fraction_outside_the_range_is_a_value_error(fraction):
    with pytest.raises(ValueError, match="device_step_fraction"):
        OffloadOptions(device_step_fraction=fraction)


def test_device_step_fraction_errors_name_the_numbers_and_the_fix():
    with pytest.raises(ValueError, match=r"device_step_fraction=1.0 must be in \[0, 1\)"):
        OffloadOptions(device_step_fraction=1.0)
    lion = functools.partial(HostOptimizer, kind="lion")
    with pytest.raises(ValueError, match="optimizer lion .needs Adam/AdamW.*set it to 0"):
        ZeroOptimizer(
            torch.nn.Linear(4, 4),
            None,
            stage=2,
            optimizer=lion,
            optimizer_kwargs={"lr": 1e-3},
            offload=OffloadOptions(device_step_fraction=0.5),
        )
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 .needs 1."):
        ZeroOptimizer(
            torch.nn.Linear(4, 4),
            None,
            stage=2,
            gradient_accumulation_steps=2,
            offload=OffloadOptions(device_step_fraction=0.5),
        )
    with pytest.raises(ValueError, match="stage 3 with offload_param keeps them on the host"):
        ZeroOptimizer(
            torch.nn.Sequential(torch.nn.Linear(400, 400)),
            None,
            stage=3,
            comm=CommOptions(param_persistence_threshold=10),
            offload=OffloadOptions(param=True, device_step_fraction=0.5),
        )


def _read(t):
    faulthandler.disable()  # the expected SIGSEGV needs no traceback
    os._exit(0 if float(t[t.numel() // 2]) == float(t[t.numel() // 2]) else 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK is Linux's")
def test_host_masters_are_not_inherited_by_a_forked_worker():
    model = torch.nn.Linear(
        4096, 4096, bias=False
    )  # 64 MiB of fp32 master: large enough to be marked
    opt = ZeroOptimizer(
        model,
        None,
        stage=1,
        optimizer_kwargs={"lr": 1e-3},
        param_groups=weight_decay_groups(model, 0.0),
        offload=OffloadOptions(pin_memory=False),
    )
    master = opt.masters[0].detach()
    assert master.device.type == "cpu" and master.numel() * 4 >= 64 * 2**20
    child = mp.get_context("fork").Process(target=_read, args=(master,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGSEGV
    opt.close()


def test_default_device_share_is_auto_on_a_gpu_else_none_and_never_an_error():
    """Left out, ``device_step_fraction`` is None: no share on a CPU device, and no error where a share
    cannot apply (Lion), while "auto" written out there names the problem. (On CUDA the default is the
    adaptive share: ``tests/gpu/run_offload_gpu.py``.)"""
    assert OffloadOptions().device_step_fraction is None
    assert (
        load_config(
            offload_config(), dp_size=1
        ).zero_optimization.offload_optimizer.device_step_fraction
        is None
    )
    lion = {"type": "Lion", "params": {"lr": 1e-4}}
    for conf in (offload_config(), {**offload_config(), "optimizer": lion}):
        assert plait.initialize(torch.nn.Linear(4, 4), conf).optimizer.stepper.share is None
    with pytest.raises(
        ValueError, match=r"device_step_fraction 'auto' cannot be used with optimizer lion"
    ):
        plait.initialize(
            torch.nn.Linear(4, 4),
            {**offload_config(device_step_fraction="auto"), "optimizer": lion},
        )


def test_auto_split_reaches_the_balanced_split_in_a_few_steps():
    """100 segments of 10 elements; the CPU steps 1 element/s, the device 3: equal times at 750 elements on
    the device. Moving half-way at the measured rates gets within the +-15% band in under 10 steps (one
    segment a step, the old rule, took 72); a fixed share never moves."""
    from types import SimpleNamespace

    from plait.zero.offload.device_share import DeviceShare

    def run(adaptive, steps):
        share = DeviceShare(
            None,
            torch.device("cpu"),
            None,
            [SimpleNamespace(shard_size=10)] * 100,
            0,
            1000,
            adaptive,
        )
        for _ in range(steps):
            on_device = 10 * share.count
            share.rebalance(cpu_seconds=(1000 - on_device) / 1.0, device_seconds=on_device / 3.0)
        return share.count

    assert 72 <= run(True, 10) <= 77  # device/CPU time within [0.85, 1.15]
    assert run(False, 10) == 0


def test_auto_split_tries_a_slower_device_once():
    """A device share so slow (0.002 against 1 element/s) that one segment of 10 elements outlasts the CPU's
    990 is tried once, then the split stays at 0: the measured device rate is remembered instead of probing
    again every other step."""
    from types import SimpleNamespace

    from plait.zero.offload.device_share import DeviceShare

    share = DeviceShare(
        None, torch.device("cpu"), None, [SimpleNamespace(shard_size=10)] * 100, 0, 1000, True
    )
    for _ in range(6):
        on_device = 10 * share.count
        share.rebalance(cpu_seconds=(1000 - on_device) / 1.0, device_seconds=on_device / 0.002)
    assert list(share.history) == [0, 1, 0, 0, 0, 0, 0]


def test_default_share_is_no_error_where_it_cannot_apply_on_a_gpu():
    """The default (None) on a CUDA device steps on the CPU where a share cannot apply (Lion, GAS 2) or where
    pin_memory is off, instead of raising as "auto" written out does. (``_device_share`` only reads the
    device's type before building a share, so a CPU run can take the CUDA branch.)"""
    lion = {"type": "Lion", "params": {"lr": 1e-4}}
    cases = [
        ({**offload_config(pin_memory=True), "optimizer": lion}, 1),
        (offload_config(pin_memory=True), 2),
        (offload_config(pin_memory=False), 1),
    ]
    for conf, gas in cases:
        stepper = plait.initialize(torch.nn.Linear(4, 4), conf).optimizer.stepper
        stepper.device = torch.device("cuda")
        assert stepper._device_share(None, gas) is None, (conf, gas)
        if gas == 2:
            with pytest.raises(
                ValueError, match=r"'auto' cannot be used with gradient_accumulation_steps=2"
            ):
                stepper._device_share("auto", gas)


def test_an_engine_dropped_without_close_frees_its_optimizer_and_offload_thread():
    before = set(
        threading.enumerate()
    )  # other tests' threads may come and go meanwhile: only new ones count
    refs = []
    for _ in range(3):
        engine = plait.initialize(torch.nn.Linear(4, 4), offload_config())
        engine.backward(engine(torch.ones(2, 4)).square().mean())
        engine.step()  # the worker thread exists once a host step ran
        refs.append(weakref.ref(engine.optimizer))
        del engine
    gc.collect()

    def new_offload_threads():
        return [
            t.name
            for t in threading.enumerate()
            if t not in before and t.name.startswith("plait-offload")
        ]

    deadline = time.monotonic() + 5.0
    while new_offload_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r() for r in refs] == [None, None, None]
    assert new_offload_threads() == []
