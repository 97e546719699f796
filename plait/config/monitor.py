"""Monitor sections of a ds_config: ``csv_monitor``, ``tensorboard``, ``wandb`` (DeepSpeed's
``deepspeed.monitor.config`` keys and defaults). The engine writes DeepSpeed's events to each enabled one
(``plait.engine.monitor``): ``Train/Samples/train_loss``, ``Train/Samples/lr`` and, with fp16,
``Train/Samples/loss_scale``, against the number of samples trained so far."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CSVMonitorConfig:
    """``csv_monitor``: one CSV file per event under ``output_path/job_name`` (``~/csv_monitor`` when
    ``output_path`` is empty, as DeepSpeed)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class TensorBoardConfig:
    """``tensorboard``: event files under ``output_path/job_name`` (``~/tensorboard`` when empty), written
    with ``torch.utils.tensorboard`` (needs the ``tensorboard`` package)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbConfig:
    """``wandb``: a Weights & Biases run in ``project`` (``team`` = entity, ``group``), written with the
    ``wandb`` package."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"
