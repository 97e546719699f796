"""Training monitors of a ds_config (``csv_monitor``, ``tensorboard``, ``wandb``), as DeepSpeed's
``deepspeed.monitor``: each event is ``(name, value, step)``, written by global rank 0 only.

The CSV monitor is plait's own (a file per event name, ``step,<last part of the name>`` rows, DeepSpeed's
layout); TensorBoard and Weights & Biases are written through their own libraries
(``torch.utils.tensorboard.SummaryWriter`` over the ``tensorboard`` package; ``wandb``).
"""

from __future__ import annotations

import csv
import os
from typing import Protocol

from plait.config import ConfigError, PlaitConfig

Event = tuple[str, float, int]


class Monitor(Protocol):
    def write_events(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


def _log_dir(output_path: str, job_name: str, default_root: str) -> str:
    root = output_path or os.path.join(os.path.expanduser("~"), default_root)
    return os.path.join(root, job_name)


class CSVMonitor:
    """``output_path/job_name/<name with / as _>.csv``, header ``step,<last part of the name>``."""

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = _log_dir(output_path, job_name, "csv_monitor")
        os.makedirs(self.log_dir, exist_ok=True)

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            path = os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="", encoding="utf-8") as fh:
                writer = csv.writer(fh)
                if new:
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardMonitor:
    def __init__(self, output_path: str, job_name: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError(
                f"tensorboard.enabled needs the tensorboard package ({err}); pip install "
                "tensorboard, or disable the section"
            ) from None
        self.writer = SummaryWriter(log_dir=_log_dir(output_path, job_name, "tensorboard"))

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbMonitor:
    def __init__(self, project: str, team: str | None, group: str | None):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "wandb.enabled needs the wandb package; pip install wandb, or disable the section"
            ) from None
        self.wandb = wandb
        if wandb.run is None:
            wandb.init(project=project, entity=team, group=group)

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        pass


def build_monitors(config: PlaitConfig, rank: int) -> list[Monitor]:
    """The monitors the config enables (none on ranks other than global rank 0).

    Raises:
        ConfigError: tensorboard or wandb enabled without its package installed.
    """
    if rank != 0:
        return []
    out: list[Monitor] = []
    if config.csv_monitor.enabled:
        out.append(CSVMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.tensorboard.enabled:
        out.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
    if config.wandb.enabled:
        w = config.wandb
        out.append(WandbMonitor(w.project, w.team, w.group))
    return out
