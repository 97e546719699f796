"""The model's two ends around its transformer blocks (``plait.layers.model``): layer 0, ``EmbeddingLayer``
(token ids -> hidden), and layer L+1, ``LMHead`` (hidden -> vocab-parallel logits -> mean cross entropy).
Both are called as ``layer(hidden, batch)``, ``batch`` the micro-batch's inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.layers.block import dropout
from plait.layers.config import TransformerConfig
from plait.layers.cross_entropy import vocab_parallel_cross_entropy
from plait.layers.embedding import VocabParallelEmbedding
from plait.layers.fused_cross_entropy import fused_linear_cross_entropy
from plait.layers.init import TIED_ATTR
from plait.layers.linear import ReplicatedLinear, enter_tp_region, replicated_param, sharded_param
from plait.layers.norm import make_norm
from plait.parallel.collectives import _split, copy_to_tp, gather_from_tp, group_size

EMBEDDING_WEIGHT = "layers.0.word_embeddings.weight"


class EmbeddingLayer(nn.Module):
    """Layer 0: ``batch["input_ids"] [b, s]`` -> hidden ``[b, s, h]`` (``[b, s/tp, h]`` with
    sequence parallelism): vocab-parallel token embedding, plus learned positions (no ``rope_theta``),
    token types (``type_vocab_size``) and a norm (``Wiring.embedding_norm``), then dropout."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        group=None,
        sequence_parallel=False,
        rng=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        c = config
        self.config, self.group, self.sequence_parallel, self.rng = c, group, sequence_parallel, rng
        self.word_embeddings = VocabParallelEmbedding(
            c.vocab_size,
            c.hidden_size,
            group=group,
            alignment=c.vocab_alignment,
            sequence_parallel=sequence_parallel,
            init_std=c.init_std,
            device=device,
            dtype=dtype,
        )
        learned = c.rope_theta is None
        self.position_embeddings = (
            replicated_param(
                (c.max_position_embeddings, c.hidden_size), "normal", c.init_std, device, dtype
            )
            if learned
            else None
        )
        self.token_type_embeddings = (
            replicated_param(
                (c.type_vocab_size, c.hidden_size), "normal", c.init_std, device, dtype
            )
            if c.type_vocab_size
            else None
        )
        self.norm = (
            make_norm(
                c.norm,
                c.hidden_size,
                c.norm_eps,
                c.bias,
                group=group,
                sequence_parallel=sequence_parallel,
                device=device,
                dtype=dtype,
            )
            if c.embedding_norm
            else None
        )

    def _table(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Lookup in a replicated table; under sequence parallelism only this rank's seq shard."""
        if self.sequence_parallel:
            return F.embedding(_split(ids, 1, self.group), copy_to_tp(weight, self.group))
        return F.embedding(ids, weight)

    def forward(self, hidden, batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        if (
            ids.shape[1] > self.config.max_position_embeddings
            and self.position_embeddings is not None
        ):
            raise ValueError(
                f"sequence length {ids.shape[1]} exceeds max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        x = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            pos = batch.get("position_ids")
            if pos is None:
                pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            x = x + self._table(self.position_embeddings, pos)
        if self.token_type_embeddings is not None:
            types = batch.get("token_type_ids")
            x = x + self._table(
                self.token_type_embeddings, torch.zeros_like(ids) if types is None else types
            )
        if self.norm is not None:
            x = self.norm(x)
        return dropout(
            x, self.config.hidden_dropout, self.training, self.rng, self.sequence_parallel
        )


class LMHead(nn.Module):
    """Layer L+1: hidden -> vocab-parallel logits ``[b, s, V_pad/tp]`` -> mean cross entropy.

    Decoders apply the final norm first; a family wired with ``head_transform`` (BERT) applies a
    dense layer and GELU before the norm, one with ``head_bias`` adds an output bias ``[V]``.
    ``forward`` returns the scalar mean loss over tokens whose label is not -100 when ``batch`` has
    ``labels``, else this rank's logits (``gather_logits`` makes them whole); ``config.head_labeled_only``
    projects only the labeled positions. With labels and
    ``config.fused_loss_chunk_tokens`` > 0 the loss comes from ``fused_linear_cross_entropy``: the
    ``[b, s, V_pad/tp]`` logits never exist at once, only one token chunk of them. The output weight is
    the embedding's when tied and both are on this rank; a tied head on a different pipeline stage
    owns a copy marked ``plait_tied_to``, initialized identically. Under context parallelism (``cp_group``
    of cp ranks, each with its part of every sequence) the returned value is the whole sequences' mean
    loss on every cp rank, and its gradient is that of ``cp x`` this rank's summed loss over the tokens
    counted on all cp ranks: the mean of those gradients over the cp ranks (what averaging gradients over
    the dp x cp ranks does) is the mean loss's gradient.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        group=None,
        sequence_parallel=False,
        tied_weight: nn.Parameter | None = None,
        cp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        c = config
        self.config, self.group, self.sequence_parallel, self.cp_group = (
            c,
            group,
            sequence_parallel,
            cp_group,
        )
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.dense = (
            ReplicatedLinear(c.hidden_size, c.hidden_size, True, init_std=c.init_std, **kw)
            if c.head_transform
            else None
        )
        self.norm = make_norm(c.norm, c.hidden_size, c.norm_eps, c.bias, **kw)
        self.vocab = VocabParallelEmbedding(
            c.vocab_size, c.hidden_size, group=group, alignment=c.vocab_alignment, device="meta"
        )  # geometry only: padded size, this rank's block
        if tied_weight is not None:
            self.weight = tied_weight
        else:
            self.weight = sharded_param(
                (c.vocab_size, c.hidden_size),
                0,
                group,
                "normal",
                c.init_std,
                padded=self.vocab.padded_vocab,
                device=device,
                dtype=dtype,
            )
            if c.tie_embeddings:
                setattr(self.weight, TIED_ATTR, EMBEDDING_WEIGHT)
        self.bias = (
            sharded_param(
                (c.vocab_size,),
                0,
                group,
                "zeros",
                padded=self.vocab.padded_vocab,
                device=device,
                dtype=dtype,
            )
            if c.head_bias
            else None
        )
        del self.vocab.weight  # the geometry helper owns no parameter

    def forward(self, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
        x = hidden
        if self.dense is not None:
            x = F.gelu(self.dense(x))
        x = enter_tp_region(self.norm(x), self.group, self.sequence_parallel)  # [b, s, h]
        labels = batch.get("labels")
        if labels is None:
            return F.linear(x, self.weight, self.bias)  # [b, s, V_pad/tp]
        if self.config.head_labeled_only:  # [n, h], [n]: the scored rows
            keep = labels != -100
            x, labels = x[keep], labels[keep]
        kw = dict(
            vocab_size=self.config.vocab_size,
            vocab_start=self.vocab.vocab_start,
            group=self.group,
            label_smoothing=self.config.label_smoothing,
        )
        chunk = self.config.fused_loss_chunk_tokens
        if chunk:  # the logits only ever exist one token chunk at a time
            total = fused_linear_cross_entropy(
                x, self.weight, self.bias, labels, chunk_tokens=chunk, reduction="sum", **kw
            )
        else:
            total = vocab_parallel_cross_entropy(
                F.linear(x, self.weight, self.bias), labels, **kw
            ).sum()
        count = (labels != -100).sum()
        cp = group_size(self.cp_group)
        if cp == 1:
            return total / count.clamp(min=1)
        sums = torch.stack(
            [total.detach().double(), count.double()]
        )  # the whole sequences' loss sum and count
        torch.distributed.all_reduce(sums, group=self.cp_group)
        local = total * cp / sums[1].clamp(min=1).to(total.dtype)
        return local + ((sums[0] / sums[1].clamp(min=1)).to(local.dtype) - local.detach())

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[b, s, V_pad/tp]`` -> whole ``[b, s, V]`` (all-gather over tp, padding dropped)."""
        return gather_from_tp(logits, self.group)[..., : self.config.vocab_size]
