"""Models as ordered layer lists: embedding, transformer blocks, head (final norm + logits + loss).

``TransformerModel`` holds layers in ``self.layers`` keyed by their global index, so a
parameter's name (``layers.3.attn.q_proj.weight``) is the same whether the model runs in one
process, split over tp, or cut into pipeline stages (build a stage with ``layers=range(a, b)``;
only those layers are constructed). Index 0 is the embedding, 1..L the blocks, L+1 the head.
Every layer is called as ``layer(hidden, batch)`` with ``batch`` a dict of the micro-batch's
inputs (``input_ids``, ``labels``, ``attention_mask``, ``position_ids``, ``token_type_ids``).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from plait.layers.block import TransformerBlock, dropout
from plait.layers.config import TransformerConfig
from plait.layers.cross_entropy import vocab_parallel_cross_entropy
from plait.layers.embedding import VocabParallelEmbedding
from plait.layers.fused_cross_entropy import fused_linear_cross_entropy
from plait.layers.init import TIED_ATTR, init_parameters
from plait.layers.linear import ReplicatedLinear, divide, enter_tp_region, replicated_param, sharded_param
from plait.layers.norm import make_norm
from plait.layers.rope import rope_cos_sin
from plait.layers.sizes import check_build_fits
from plait.parallel import context
from plait.parallel.collectives import _split, copy_to_tp, gather_from_tp, group_size
from plait.parallel.random import RNGTracker
from plait.parallel.sharding import logical_parts

EMBEDDING_WEIGHT = "layers.0.word_embeddings.weight"


class EmbeddingLayer(nn.Module):
    """Layer 0: ``batch["input_ids"] [b, s]`` -> hidden ``[b, s, h]`` (``[b, s/tp, h]`` with
    sequence parallelism): vocab-parallel token embedding, plus learned positions (no ``rope_theta``),
    token types (``type_vocab_size``) and a norm (``Wiring.embedding_norm``), then dropout."""

    def __init__(self, config: TransformerConfig, *, group=None, sequence_parallel=False, rng=None,
                 device=None, dtype=None):
        super().__init__()
        c = config
        self.config, self.group, self.sequence_parallel, self.rng = c, group, sequence_parallel, rng
        self.word_embeddings = VocabParallelEmbedding(c.vocab_size, c.hidden_size, group=group,
                                                      alignment=c.vocab_alignment, sequence_parallel=sequence_parallel,
                                                      init_std=c.init_std, device=device, dtype=dtype)
        learned = c.rope_theta is None
        self.position_embeddings = (replicated_param((c.max_position_embeddings, c.hidden_size), "normal",
                                                     c.init_std, device, dtype) if learned else None)
        self.token_type_embeddings = (replicated_param((c.type_vocab_size, c.hidden_size), "normal", c.init_std,
                                                       device, dtype) if c.type_vocab_size else None)
        self.norm = (make_norm(c.norm, c.hidden_size, c.norm_eps, c.bias, group=group,
                               sequence_parallel=sequence_parallel, device=device, dtype=dtype)
                     if c.embedding_norm else None)

    def _table(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Lookup in a replicated table; under sequence parallelism only this rank's seq shard."""
        if self.sequence_parallel:
            return F.embedding(_split(ids, 1, self.group), copy_to_tp(weight, self.group))
        return F.embedding(ids, weight)

    def forward(self, hidden, batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        if ids.shape[1] > self.config.max_position_embeddings and self.position_embeddings is not None:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        x = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            pos = batch.get("position_ids")
            if pos is None:
                pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            x = x + self._table(self.position_embeddings, pos)
        if self.token_type_embeddings is not None:
            types = batch.get("token_type_ids")
            x = x + self._table(self.token_type_embeddings, torch.zeros_like(ids) if types is None else types)
        if self.norm is not None:
            x = self.norm(x)
        return dropout(x, self.config.hidden_dropout, self.training, self.rng, self.sequence_parallel)


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

    def __init__(self, config: TransformerConfig, *, group=None, sequence_parallel=False,
                 tied_weight: nn.Parameter | None = None, cp_group=None, device=None, dtype=None):
        super().__init__()
        c = config
        self.config, self.group, self.sequence_parallel, self.cp_group = c, group, sequence_parallel, cp_group
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.dense = (ReplicatedLinear(c.hidden_size, c.hidden_size, True, init_std=c.init_std, **kw)
                      if c.head_transform else None)
        self.norm = make_norm(c.norm, c.hidden_size, c.norm_eps, c.bias, **kw)
        self.vocab = VocabParallelEmbedding(c.vocab_size, c.hidden_size, group=group, alignment=c.vocab_alignment,
                                            device="meta")  # geometry only: padded size, this rank's block
        if tied_weight is not None:
            self.weight = tied_weight
        else:
            self.weight = sharded_param((c.vocab_size, c.hidden_size), 0, group, "normal", c.init_std,
                                        padded=self.vocab.padded_vocab, device=device, dtype=dtype)
            if c.tie_embeddings:
                setattr(self.weight, TIED_ATTR, EMBEDDING_WEIGHT)
        self.bias = (sharded_param((c.vocab_size,), 0, group, "zeros", padded=self.vocab.padded_vocab,
                                   device=device, dtype=dtype) if c.head_bias else None)
        del self.vocab.weight  # the geometry helper owns no parameter

    def forward(self, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
        x = hidden
        if self.dense is not None:
            x = F.gelu(self.dense(x))
        x = enter_tp_region(self.norm(x), self.group, self.sequence_parallel)   # [b, s, h]
        labels = batch.get("labels")
        if labels is None:
            return F.linear(x, self.weight, self.bias)                           # [b, s, V_pad/tp]
        if self.config.head_labeled_only:                                        # [n, h], [n]: the scored rows
            keep = labels != -100
            x, labels = x[keep], labels[keep]
        kw = dict(vocab_size=self.config.vocab_size, vocab_start=self.vocab.vocab_start, group=self.group,
                  label_smoothing=self.config.label_smoothing)
        chunk = self.config.fused_loss_chunk_tokens
        if chunk:   # the logits only ever exist one token chunk at a time
            total = fused_linear_cross_entropy(x, self.weight, self.bias, labels, chunk_tokens=chunk,
                                               reduction="sum", **kw)
        else:
            total = vocab_parallel_cross_entropy(F.linear(x, self.weight, self.bias), labels, **kw).sum()
        count = (labels != -100).sum()
        cp = group_size(self.cp_group)
        if cp == 1:
            return total / count.clamp(min=1)
        sums = torch.stack([total.detach().double(), count.double()])   # the whole sequences' loss sum and count
        torch.distributed.all_reduce(sums, group=self.cp_group)
        local = total * cp / sums[1].clamp(min=1).to(total.dtype)
        return local + ((sums[0] / sums[1].clamp(min=1)).to(local.dtype) - local.detach())

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[b, s, V_pad/tp]`` -> whole ``[b, s, V]`` (all-gather over tp, padding dropped)."""
        return gather_from_tp(logits, self.group)[..., : self.config.vocab_size]


def check_tensor_parallel(config: TransformerConfig, tp: int) -> None:
    """Raise ValueError naming the numbers when the architecture cannot be split over ``tp`` ranks."""
    divide(config.hidden_size, tp, "hidden_size")
    divide(config.num_heads, tp, "num_heads")
    divide(config.num_kv_heads, tp, "num_kv_heads")
    divide(config.ffn_hidden_size, tp, "ffn_hidden_size")


class TransformerModel(nn.Module):
    """A GPT-2 / Llama / BERT model (or a pipeline stage of one) built from plait layers.

    Args:
        config: architecture. mesh: ``ParallelMesh`` (None: one process).
        sequence_parallel: shard activations outside attention/MLP along seq over tp.
        layers: global layer indices to build (default all: ``0 .. num_layers + 1``).
        seed: initialization and dropout seed (layout-invariant; see ``plait.layers.init``).
        recompute: activation recomputation per block (None, "full" or "selective").
        cp_method: "ring" or "all_to_all" attention where ``mesh.cp`` > 1 (context parallelism: each rank
            gets the two sequence chunks of ``plait.parallel.context.shard_sequence`` of every input; the
            default positions follow them).
        device, dtype: where and in what dtype to build; "meta" skips initialization.

    ``forward(input_ids=..., labels=..., attention_mask=..., position_ids=..., token_type_ids=...,
    hidden=None, aux_loss_scale=None)`` runs the built layers in order and returns the mean loss (when the
    head is built and ``labels`` given), the head's local logits, or the hidden state ``[b, s(/tp), h]``.
    The mixture-of-experts losses are not in the returned loss: each block joins them to the gradient
    (``plait.layers.moe.add_loss_gradient``) scaled by ``aux_loss_scale`` (default 1: right for
    ``loss.backward()``; pass the factor a backward of ``c x loss`` applies, e.g. 1/GAS, as the engine does).

    Raises:
        ValueError: sizes not divisible by tp, layer indices out of range, or (off the meta device) parameters
            that alone need more memory than the device has (``plait.layers.sizes.check_build_fits``).
    """

    def __init__(self, config: TransformerConfig, mesh=None, *, sequence_parallel: bool = False,
                 layers: Iterable[int] | None = None, seed: int = 1234, recompute: str | None = None,
                 cp_method: str = "ring", device=None, dtype=None):
        super().__init__()
        group = None if mesh is None else mesh.tp_group
        cp_group = None if mesh is None else mesh.cp_group
        ep_group = mesh.ep_group if mesh is not None and config.num_experts else None
        tp = group_size(group)
        check_tensor_parallel(config, tp)
        self.config, self.mesh, self.sequence_parallel = config, mesh, sequence_parallel and tp > 1
        total = config.num_layers + 2
        indices = list(range(total)) if layers is None else sorted(set(layers))
        if not indices or indices[0] < 0 or indices[-1] >= total:
            raise ValueError(f"layer indices must lie in [0, {total}) for {config.num_layers} blocks, got {indices}")
        self.layer_indices = indices
        check_build_fits(config, mesh, indices, device, dtype)
        if config.num_experts and group_size(cp_group) > 1:
            raise ValueError("num_experts > 0 with context parallelism is not supported yet (each cp rank's "
                             "balance loss would see only its part of every sequence): use cp 1")
        cpu_rng = device is None or torch.device(device).type == "meta"
        rng_device = torch.device("cpu") if cpu_rng else torch.device(device)
        # Dropout streams differ per pipeline chunk (keyed by its first layer, so interleaved chunks on
        # one rank differ too) and per tp rank inside tp-split regions; see plait.parallel.random.
        cp_rank = 0 if mesh is None else mesh.cp_rank   # cp ranks hold other positions: other dropout masks
        self.rng = RNGTracker(seed + 100 * indices[0] + 1_000_003 * cp_rank, 0 if mesh is None else mesh.tp_rank,
                              rng_device)
        kw = dict(group=group, sequence_parallel=self.sequence_parallel, device=device, dtype=dtype)
        self.layers = nn.ModuleDict()
        for i in indices:
            if i == 0:
                self.layers[str(i)] = EmbeddingLayer(config, rng=self.rng, **kw)
            elif i == total - 1:
                tied = (self.layers["0"].word_embeddings.weight
                        if config.tie_embeddings and "0" in self.layers else None)
                self.layers[str(i)] = LMHead(config, tied_weight=tied, cp_group=cp_group, **kw)
            else:
                self.layers[str(i)] = TransformerBlock(config, rng=self.rng, recompute=recompute, cp_group=cp_group,
                                                       cp_method=cp_method, ep_group=ep_group, **kw)
        init_parameters(self, seed)

    @property
    def _has_blocks(self) -> bool:
        return any(0 < i <= self.config.num_layers for i in self.layer_indices)

    def _positions(self, batch: dict, hidden) -> torch.Tensor:
        """``[1, s]`` positions of this rank's tokens when ``position_ids`` is not given: ``0..s-1`` of the
        whole sequence, or under context parallelism those of this rank's chunks."""
        ids = batch.get("input_ids")
        seq = ids.shape[1] if ids is not None else hidden.shape[1] * (group_size(self.mesh.tp_group)
                                                                      if self.sequence_parallel else 1)
        cp = 1 if self.mesh is None else self.mesh.cp
        if self.config.rope_theta is None and seq * cp > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {seq * cp} ({seq} on each of cp={cp} ranks) exceeds "
                             f"max_position_embeddings ({self.config.max_position_embeddings})")
        device = ids.device if ids is not None else hidden.device
        return context.positions(seq * cp, cp, 0 if cp == 1 else self.mesh.cp_rank, device).unsqueeze(0)

    def _rope_tables(self, batch: dict, hidden):
        """RoPE's ``(cos, sin)`` for every block of this forward, computed once (``[b or 1, 1, s, head_dim]``
        float32), from ``position_ids``."""
        return rope_cos_sin(batch["position_ids"], self.config.head_dim, self.config.rope_theta)

    @property
    def has_head(self) -> bool:
        return str(self.config.num_layers + 1) in self.layers

    @property
    def head(self) -> LMHead:
        return self.layers[str(self.config.num_layers + 1)]

    def forward(self, input_ids=None, labels=None, attention_mask=None, position_ids=None,
                token_type_ids=None, hidden=None, aux_loss_scale=None):
        batch = {k: v for k, v in dict(input_ids=input_ids, labels=labels, attention_mask=attention_mask,
                                       position_ids=position_ids, token_type_ids=token_type_ids,
                                       aux_loss_scale=aux_loss_scale).items()
                 if v is not None}
        if "position_ids" not in batch and (self.config.rope_theta is not None or self.mesh is not None
                                            and self.mesh.cp > 1):
            batch["position_ids"] = self._positions(batch, hidden)   # learned positions take them too under cp
        if self.config.rope_theta is not None and self._has_blocks:
            batch["rope"] = self._rope_tables(batch, hidden)
        for layer in self.layers.values():
            hidden = layer(hidden, batch)
        return hidden


def logical_shapes(config: TransformerConfig, layers: Iterable[int] | None = None) -> dict[str, tuple[int, ...]]:
    """Parameter name -> logical (whole, unpadded) shape of ``config``'s model, or of only the
    global layer indices ``layers``; built on the meta device, so nothing is allocated. A tied
    output weight built with its embedding appears once (under the embedding's name)."""
    model = TransformerModel(config, layers=layers, device="meta")
    return {part.name: tuple(part.spec.logical_shape) for n, p in model.named_parameters()
            for part in logical_parts(n, p)}
