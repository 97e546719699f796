"""What the engine reports (``steps_per_print``, ``wall_clock_breakdown``, the CSV/TensorBoard/W&B monitors)
and ``fp16.auto_cast``: each config key does what DeepSpeed does with it, checked against the numbers the
training loop itself sees (one process, float32, exact: the monitor writes the same float the loop reads)."""

import csv
import sys
import types

import pytest
import torch
from torch import nn

import plait
from plait.config import ConfigError
from plait.layers import TransformerModel
from helpers import tiny

GAS, MICRO = 2, 2


def tiny_model():
    return TransformerModel(tiny(vocab_size=97), None, seed=3)


def engine_with(**extra):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }
    return plait.initialize(tiny_model(), cfg)


def train(engine, steps):
    """Losses the loop sees, one mean per optimizer step."""
    means = []
    for step in range(steps):
        total = 0.0
        for micro in range(GAS):
            ids = torch.randint(
                0, 97, (MICRO, 9), generator=torch.Generator().manual_seed(10 * step + micro)
            )
            loss = engine(input_ids=ids[:, :-1], labels=ids[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.item() / GAS
        means.append(total)
    return means


def test_steps_per_print_prints_deepspeeds_line_every_n_steps(capsys):
    engine = engine_with(steps_per_print=2)
    train(engine, 5)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step=")]
    assert lines == [
        f"step={n}, skipped=0, lr=[0.001, 0.001], mom=[(0.9, 0.999), (0.9, 0.999)]" for n in (2, 4)
    ]


def test_wall_clock_breakdown_prints_the_window_times(capsys):
    engine = engine_with(steps_per_print=3, wall_clock_breakdown=True)
    train(engine, 3)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("time (ms)")]
    assert len(line) == 1
    times = dict(part.split(": ") for part in line[0].split(" | ")[1:])
    assert set(times) == {"forward", "backward", "step"} and all(
        float(v) > 0 for v in times.values()
    )


def test_without_breakdown_nothing_is_timed(capsys):
    engine = engine_with(steps_per_print=1)
    train(engine, 1)
    assert "time (ms)" not in capsys.readouterr().out and engine.report.window["forward"] == 0.0


def read_csv(path):
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def test_csv_monitor_writes_deepspeeds_events(tmp_path):
    engine = engine_with(
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "run1"},
        fp16={"enabled": True, "initial_scale_power": 8},
        steps_per_print=100,
    )
    losses = train(engine, 3)
    samples = [MICRO * GAS * (n + 1) for n in range(3)]
    header, rows = read_csv(tmp_path / "run1" / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"] and [s for s, _ in rows] == samples
    assert [v for _, v in rows] == pytest.approx(
        losses, rel=1e-6
    )  # fp32 sum of the same fp32 losses
    assert read_csv(tmp_path / "run1" / "Train_Samples_lr.csv")[1] == [(s, 1e-3) for s in samples]
    scales = read_csv(tmp_path / "run1" / "Train_Samples_loss_scale.csv")[1]
    assert [v for _, v in scales] == [engine.loss_scale] * 3


class FakeWriter:
    events = []

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def add_scalar(self, name, value, step):
        FakeWriter.events.append((self.log_dir, name, value, step))

    def flush(self):
        pass

    def close(self):
        pass


def test_tensorboard_monitor_writes_through_summary_writer(tmp_path, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter)
    )
    FakeWriter.events = []
    engine = engine_with(
        tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}
    )
    losses = train(engine, 2)
    got = [(name, step) for _, name, _, step in FakeWriter.events]
    assert got == [
        ("Train/Samples/train_loss", 4),
        ("Train/Samples/lr", 4),
        ("Train/Samples/train_loss", 8),
        ("Train/Samples/lr", 8),
    ]
    assert FakeWriter.events[2][2] == pytest.approx(losses[1], rel=1e-6)
    assert FakeWriter.events[0][0] == str(tmp_path / "tb")


def test_wandb_monitor_logs_each_event(monkeypatch):
    logged = []
    fake = types.SimpleNamespace(
        run=None,
        init=lambda **kw: logged.append(("init", kw)),
        log=lambda data, step: logged.append((data, step)),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    engine = engine_with(wandb={"enabled": True, "project": "p", "team": "t"})
    train(engine, 1)
    assert logged[0] == ("init", {"project": "p", "entity": "t", "group": None})
    assert [list(d)[0] for d, _ in logged[1:]] == ["Train/Samples/train_loss", "Train/Samples/lr"]


@pytest.mark.parametrize(
    "section, package", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")]
)
def test_a_monitor_without_its_package_is_refused_naming_it(section, package, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    with pytest.raises(ConfigError, match=f"pip install {section}"):
        engine_with(**{section: {"enabled": True}})


class Recorder(nn.Module):
    """Records the dtype its float input arrives in."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 1)
        self.seen = []

    def forward(self, x, ids):
        self.seen.append((x.dtype, ids.dtype))
        return self.proj(x.to(self.proj.weight.dtype)).float().mean()


@pytest.mark.parametrize("auto_cast, want", [(True, torch.float16), (False, torch.float32)])
def test_fp16_auto_cast_casts_float_inputs_only(auto_cast, want):
    model = Recorder()
    engine = plait.initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": 1,
            "fp16": {"enabled": True, "auto_cast": auto_cast},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    engine.backward(engine(torch.ones(2, 4), ids=torch.zeros(2, dtype=torch.long)))
    assert model.seen == [(want, torch.long)]
