"""Timing a pipeline step's compute actions (``PipelineExecutor.time_compute``): ``ActionTime`` records,
and the device clock they are read from (CUDA events on a GPU, ``time.perf_counter`` elsewhere)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from plait.parallel.pipeline.schedules import Action


@dataclass(frozen=True)
class ActionTime:
    """One compute action of a timed step (``PipelineExecutor.time_compute``): seconds since the step
    began on this rank's device (``start``, ``end``; CUDA events on GPU) and the host seconds spent
    issuing it (``host``; when ``host`` exceeds ``end - start`` the device waited for the host)."""

    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float
    host: float


def mark(device: torch.device):
    """A point on ``device``'s clock: a recorded CUDA event on a GPU, else ``time.perf_counter()``."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def timeline(
    device: torch.device, origin, spans: list[tuple[Action, object, object, float]]
) -> list[ActionTime]:
    """``ActionTime`` s of ``spans`` (``(action, start mark, end mark, host seconds)``) in seconds since
    ``origin`` (a ``mark``); waits for the GPU first."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        since = lambda e: origin.elapsed_time(e) / 1e3  # noqa: E731
    else:
        since = lambda t: t - origin  # noqa: E731
    return [
        ActionTime(a.kind, a.microbatch, a.chunk, since(s), since(e), host)
        for a, s, e, host in spans
    ]
