"""What ``plait.checkpoint`` needs from a trainer to save it and load into it: the ``Checkpointable``
Protocol (``plait.engine.Engine`` implements it), the trainer's JSON and RNG state as plain data
(``TrainerState``, ``RngState``), and the ``WriterSlot`` a trainer holds for its own checkpoint writer.

How these map to the files (``FORMAT.md``): the model chunks' weights and the optimizer's ZeRO pieces are
the tensors; ``TrainerState`` is ``meta.json``'s ``engine.global_samples``, ``engine.lr_scheduler``,
``config`` and ``data_loader``; ``RngState`` is this rank's entry of ``rank_meta.json``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from plait.checkpoint.writer import CheckpointWriter
from plait.parallel.mesh import ParallelMesh
from plait.zero.slices import ShardState


class ShardedOptimizer(Protocol):
    """The optimizer side of a checkpoint (``plait.zero.ZeroOptimizer``): its slot names are the parameter
    names of ``module``; ``load_shard_state``'s ``read(slot, kind, start, length)`` returns float32 elements
    ``[start, start + length)`` of a slot's flattened local shard (``kind``: ``"master"`` or a state name)."""

    module: nn.Module

    def shard_state(self) -> ShardState: ...

    def load_shard_state(
        self, read: Callable[[str, str, int, int], torch.Tensor], state: ShardState | None = None
    ) -> None: ...

    def gathered_parameters(self, modifier_rank: int | None = None) -> AbstractContextManager: ...


@dataclass
class TrainerState:
    """A trainer's JSON state beside the tensors. On load a None field is not in the checkpoint (or not
    asked for) and leaves the trainer's own value alone.

    Attributes:
        global_samples: samples trained on so far. lr_scheduler: the schedule's ``state_dict()``.
        config: the resolved ds_config (saved only; the loading trainer keeps its own).
        data_loader: the ``state_dict()`` of a loader whose position is kept.
    """

    global_samples: int | None = None
    lr_scheduler: dict | None = None
    config: dict | None = None
    data_loader: dict | None = None


@dataclass
class RngState:
    """One rank's random-number generators: torch's CPU generator state, the current CUDA device's (None
    without one), and per model chunk index the tensor-parallel RNG tracker's named states."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None
    trackers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


class WriterSlot:
    """A trainer's checkpoint writer (it keeps the async queue and the side process group between saves):
    saves to the same root with the same ``keep_last`` reuse it; another root or ``keep_last`` first waits
    for the old writer's pending save, then makes a new writer."""

    def __init__(self):
        self._writer: CheckpointWriter | None = None

    def writer(self, root: str | os.PathLike, keep_last: int | None) -> CheckpointWriter:
        """The writer for ``root`` (see the class docstring)."""
        writer = self._writer
        if writer is None or str(writer.root) != str(root) or writer.keep_last != keep_last:
            if writer is not None:
                writer.wait()
            writer = self._writer = CheckpointWriter(root, keep_last=keep_last)
        return writer


@runtime_checkable
class Checkpointable(Protocol):
    """What ``plait.checkpoint.engine_io`` saves and loads into (``plait.engine.Engine`` implements it).

    Attributes:
        mesh: the ``ParallelMesh`` (which boxes this rank writes and reads).
        optimizer: the ``ShardedOptimizer`` holding the master weights and optimizer state.
        checkpoint_writer: the trainer's ``WriterSlot``.
        global_steps: optimizer steps so far (the default tag is ``global_step<N>``).
        gathers_16bit_on_save: whether ``export16`` may gather the whole model at a save (ZeRO-3 may not).
    """

    mesh: ParallelMesh
    optimizer: ShardedOptimizer
    checkpoint_writer: WriterSlot
    gathers_16bit_on_save: bool

    @property
    def global_steps(self) -> int: ...

    def model_chunks(self) -> list[nn.Module]:
        """This rank's model chunks: its pipeline stage modules, else the one model."""
        ...

    def trainer_state(self) -> TrainerState: ...

    def load_trainer_state(self, state: TrainerState) -> None: ...

    def rng_state(self) -> RngState: ...

    def load_rng_state(self, state: RngState) -> None: ...
