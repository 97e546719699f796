"""Vocabulary-parallel embedding (Shoeybi et al., "Megatron-LM", 2019, Sec. 3, "input embedding").

The vocabulary is padded to a multiple of ``tp * alignment`` and each tp rank holds a
contiguous block of ``padded_vocab / tp`` rows. Tokens outside a rank's block look up zeros
there, and the partial outputs are summed over tp (all-reduce, or reduce-scatter to a
sequence shard with sequence parallelism). Padded rows are initialised to zero, never
selected by a real token id, and never appear in checkpoints.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from plait.layers.linear import leave_tp_region, sharded_param
from plait.parallel.collectives import group_rank, group_size


def padded_vocab_size(vocab_size: int, tp: int, alignment: int = 128) -> int:
    """Smallest multiple of ``tp * alignment`` that is >= ``vocab_size`` (rows)."""
    if vocab_size < 1 or tp < 1 or alignment < 1:
        raise ValueError(
            f"vocab_size ({vocab_size}), tp ({tp}) and alignment ({alignment}) must be >= 1"
        )
    step = tp * alignment
    return math.ceil(vocab_size / step) * step


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows split over tp.

    Args:
        vocab_size: real vocabulary size (before padding).
        hidden_size: embedding width.
        group: tp group (None: one process). alignment: padding granularity per tp rank.
        sequence_parallel: return this rank's sequence shard ``[b, s/tp, h]``.

    Shapes: ``input_ids [b, s]`` (int64) -> ``[b, s, h]`` (``[b, s/tp, h]`` with sequence_parallel).
    Attributes ``vocab_start`` / ``vocab_end`` give this rank's row block in padded ids.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        group=None,
        alignment: int = 128,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = group_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab_size(vocab_size, tp, alignment)
        per_rank = self.padded_vocab // tp
        self.vocab_start = group_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = sharded_param(
            (vocab_size, hidden_size),
            0,
            group,
            "normal",
            init_std,
            padded=self.padded_vocab,
            device=device,
            dtype=dtype,
        )

    def partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial lookup ``[b, s, h]`` (zeros for ids outside its block), before the sum."""
        if group_size(self.group) == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return leave_tp_region(self.partial(input_ids), self.group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.vocab_size} (padded {self.padded_vocab}), rows [{self.vocab_start}, "
            f"{self.vocab_end}), sequence_parallel={self.sequence_parallel}"
        )
