"""Pipeline stages of plait's models: ``build_stage_modules`` builds this rank's chunks, each a
``TransformerStage`` (a ``TransformerModel`` holding only its layers) that offers what
``plait.parallel.pipeline.stage.StageChunk`` asks of a pipeline chunk; ``layer_parameter_counts`` weighs the
layers for ``partition_layers(..., method="parameters")``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from plait.layers.init import TIED_ATTR
from plait.layers.model import TransformerModel, logical_shapes
from plait.parallel.collectives import group_size
from plait.parallel.pipeline.partition import partition_layers, stage_layers
from plait.parallel.pipeline.registry import placement


class TransformerStage(TransformerModel):
    """A ``TransformerModel`` built for one pipeline stage (``layers=range(start, stop)``): the same
    parameters and names, plus the ``StageChunk`` members the pipeline uses."""

    @property
    def tied_across_stages(self) -> bool:
        """True when the config ties the word embedding and the head (on every chunk of the model)."""
        return bool(self.config.tie_embeddings)

    def activation_shape(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
        """``(b, s, hidden)`` from ``batch["input_ids"] [b, s]``; ``(b, s/tp, hidden)`` under sequence
        parallelism.

        Raises:
            ValueError: under sequence parallelism, ``s`` not divisible by tp.
        """
        b, s = batch["input_ids"].shape[:2]
        if self.sequence_parallel:
            tp = group_size(self.mesh.tp_group)
            if s % tp:
                raise ValueError(
                    f"sequence length {s} is not divisible by tp ({tp}) under sequence "
                    f"parallelism; pad the micro-batch to a multiple of {tp}"
                )
            s //= tp
        return (b, s, self.config.hidden_size)

    def tied_parameters(self) -> list[nn.Parameter]:
        """The word embedding (when this chunk holds layer 0) and the head's copy of it (when it holds
        the head), unless this one chunk holds both (they are then the same parameter).

        Raises:
            ValueError: the head's weight is no tied copy although the config ties them.
        """
        first, head = "0" in self.layers, self.has_head
        if not self.config.tie_embeddings or (first and head):
            return []
        params = [self.layers["0"].word_embeddings.weight] if first else []
        if head:
            if getattr(self.head.weight, TIED_ATTR, None) is None:
                raise ValueError(
                    "the head chunk has no tied copy of the embedding although the config ties "
                    "them; build chunks with build_stage_modules"
                )
            params.append(self.head.weight)
        return params


def layer_parameter_counts(config) -> list[int]:
    """Logical parameter count of each of the ``num_layers + 2`` layers (no vocabulary padding).

    From ``logical_shapes`` of one layer of each kind (embedding, block, head), so nothing is
    materialized. The head counts its own output weight when tied embeddings put it on another
    stage than the embedding (that copy occupies memory there); all blocks are identical.
    """
    last = config.num_layers + 1

    def count(index: int) -> int:
        return sum(math.prod(shape) for shape in logical_shapes(config, layers=[index]).values())

    block = count(1) if config.num_layers else 0
    return [count(0)] + [block] * config.num_layers + [count(last)]


def build_stage_modules(
    config,
    mesh=None,
    v: int = 1,
    method: str | Sequence[int] = "uniform",
    *,
    sequence_parallel: bool = False,
    seed: int = 1234,
    recompute: str | None = None,
    cp_method: str = "ring",
    device=None,
    dtype=None,
    schedule: str | None = None,
) -> list[TransformerStage]:
    """Build this rank's ``v`` model chunks, each a ``TransformerStage`` with only its layers.

    Args:
        config: ``TransformerConfig``. mesh: ``ParallelMesh`` (None: one process, p = 1).
        v: model chunks per rank (virtual stages; 1 unless the schedule is "interleaved" or "zb-v").
        method: see ``plait.parallel.pipeline.partition.partition_layers`` ("parameters" uses
            :func:`layer_parameter_counts`).
        sequence_parallel, seed, recompute, cp_method, device, dtype: passed to every chunk (``TransformerModel``);
            the same seed on every rank gives layout-invariant weights.
        schedule: the pipeline schedule the chunks will run; its stage placement
            (``plait.parallel.pipeline.registry.placement``: "v" for "zb-v") says which stages this rank holds.
            None: the "loop" placement of every other schedule.

    Returns:
        ``[chunk_0, ..., chunk_{v-1}]``; chunk ``c`` holds ``layers=range(start, stop)`` of virtual
        stage ``stage_of(pp_rank, c, p, placement(schedule))`` ("loop": ``c*p + pp_rank``). No rank ever
        builds a layer outside its own stages.

    Raises:
        ValueError: from ``partition_layers`` (too few layers, bad boundaries).
    """
    p = 1 if mesh is None else mesh.pp
    rank = 0 if mesh is None else mesh.pp_rank
    n = config.num_layers + 2
    weights = layer_parameter_counts(config) if method == "parameters" else None
    parts = partition_layers(n, p, v, method, weights)
    return [
        TransformerStage(
            config,
            mesh,
            sequence_parallel=sequence_parallel,
            layers=layers,
            seed=seed,
            recompute=recompute,
            cp_method=cp_method,
            device=device,
            dtype=dtype,
        )
        for layers in stage_layers(parts, p, rank, placement(schedule) if schedule else "loop")
    ]
