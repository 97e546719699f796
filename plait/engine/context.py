"""Context parallelism in the engine: the config against the mesh and the model, and each rank's part of
every sequence (``plait.parallel.context``)."""

from __future__ import annotations

import torch
from torch import nn

from plait.config import ConfigError, PlaitConfig
from plait.parallel import context

#: batch entries laid out ``[b, s, ...]``: each cp rank keeps its two chunks of dim 1
SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "token_type_ids", "attention_mask")


def check_context_parallel(config: PlaitConfig, mesh, module: nn.Module, pipeline) -> None:
    """Raises ConfigError when ``context_parallel`` disagrees with the mesh or with the attention layers'
    ``cp_method`` (a pipeline rank whose stages hold no attention layer has nothing to check)."""
    cp = config.context_parallel
    if cp.size != mesh.cp:
        raise ConfigError(
            f"config asks for context_parallel.size={cp.size} but the mesh has cp={mesh.cp}; build "
            f"the mesh as ParallelMesh(..., cp={cp.size}) (or let plait.initialize build it)"
        )
    if cp.size == 1:
        return
    methods = {m.cp_method for m in module.modules() if hasattr(m, "cp_method") and m.cp > 1}
    if (
        not methods
        and pipeline is not None
        and not any(hasattr(m, "cp_method") for m in module.modules())
    ):
        return  # this pipeline rank's stages hold no attention layer (only the embedding or the head)
    if not methods:
        raise ConfigError(
            f"context_parallel.size={cp.size} but no attention layer of the model splits the sequence: "
            "build it with the mesh (TransformerModel(config, mesh, cp_method=...))"
        )
    if methods != {cp.method}:
        raise ConfigError(
            f"context_parallel.method is {cp.method!r} but the model's attention uses {sorted(methods)}; "
            f"build the model with cp_method={cp.method!r}"
        )


def shard_batch(batch: dict, mesh, args: tuple = ()) -> dict:
    """This cp rank's part of every sequence in ``batch`` (``SEQUENCE_KEYS``; the whole batch at cp 1).

    Raises:
        ValueError: a sequence length that is not a multiple of 2 x cp (``context.check_sequence``), or
            tensors passed by position (``args``), whose role is unknown, under cp > 1.
    """
    if mesh.cp == 1:
        return batch
    if any(torch.is_tensor(a) for a in args):
        raise ValueError(
            "under context parallelism pass the batch by keyword (input_ids=..., labels=...): the "
            "engine keeps each rank's chunks of the sequence entries it knows by name"
        )
    return {
        k: context.shard_sequence(v, mesh.cp, mesh.cp_rank, dim=1)
        if k in SEQUENCE_KEYS and torch.is_tensor(v) and v.dim() >= 2
        else v
        for k, v in batch.items()
    }
