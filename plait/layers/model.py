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
from torch import nn

from plait.layers.block import TransformerBlock
from plait.layers.config import TransformerConfig
from plait.layers.ends import EmbeddingLayer, LMHead
from plait.layers.init import init_parameters
from plait.layers.linear import divide
from plait.layers.rope import rope_cos_sin
from plait.layers.sizes import check_build_fits
from plait.parallel import context
from plait.parallel.collectives import group_size
from plait.parallel.random import RNGTracker
from plait.parallel.sharding import logical_parts


def layer_indices(config: TransformerConfig, layers: Iterable[int] | None) -> list[int]:
    """The sorted global indices to build (all of ``0 .. num_layers + 1`` when ``layers`` is None).
    Raises ValueError naming them when one is out of range."""
    total = config.num_layers + 2
    indices = list(range(total)) if layers is None else sorted(set(layers))
    if not indices or indices[0] < 0 or indices[-1] >= total:
        raise ValueError(
            f"layer indices must lie in [0, {total}) for {config.num_layers} blocks, got {indices}"
        )
    return indices


def build_layers(
    config: TransformerConfig,
    indices: list[int],
    rng: RNGTracker,
    kw: dict,
    *,
    recompute,
    cp_group,
    cp_method: str,
    ep_group,
) -> nn.ModuleDict:
    """Layers ``indices`` keyed by their global index: the embedding (0), the blocks, the head (L+1), the head
    tied to the embedding's weight when both are built here; ``kw``: the tp group, sequence parallelism,
    device and dtype every layer takes."""
    out, last = nn.ModuleDict(), config.num_layers + 1
    for i in indices:
        if i == 0:
            out[str(i)] = EmbeddingLayer(config, rng=rng, **kw)
        elif i == last:
            tied = out["0"].word_embeddings.weight if config.tie_embeddings and "0" in out else None
            out[str(i)] = LMHead(config, tied_weight=tied, cp_group=cp_group, **kw)
        else:
            out[str(i)] = TransformerBlock(
                config,
                rng=rng,
                recompute=recompute,
                cp_group=cp_group,
                cp_method=cp_method,
                ep_group=ep_group,
                **kw,
            )
    return out


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

    def __init__(
        self,
        config: TransformerConfig,
        mesh=None,
        *,
        sequence_parallel: bool = False,
        layers: Iterable[int] | None = None,
        seed: int = 1234,
        recompute: str | None = None,
        cp_method: str = "ring",
        device=None,
        dtype=None,
    ):
        super().__init__()
        group = None if mesh is None else mesh.tp_group
        cp_group = None if mesh is None else mesh.cp_group
        ep_group = mesh.ep_group if mesh is not None and config.num_experts else None
        tp = group_size(group)
        check_tensor_parallel(config, tp)
        self.config, self.mesh, self.sequence_parallel = config, mesh, sequence_parallel and tp > 1
        self.layer_indices = indices = layer_indices(config, layers)
        check_build_fits(config, mesh, indices, device, dtype)
        if config.num_experts and group_size(cp_group) > 1:
            raise ValueError(
                "num_experts > 0 with context parallelism is not supported yet (each cp rank's "
                "balance loss would see only its part of every sequence): use cp 1"
            )
        cpu_rng = device is None or torch.device(device).type == "meta"
        rng_device = torch.device("cpu") if cpu_rng else torch.device(device)
        # Dropout streams differ per pipeline chunk (keyed by its first layer, so interleaved chunks on
        # one rank differ too) and per tp rank inside tp-split regions; see plait.parallel.random.
        cp_rank = (
            0 if mesh is None else mesh.cp_rank
        )  # cp ranks hold other positions: other dropout masks
        self.rng = RNGTracker(
            seed + 100 * indices[0] + 1_000_003 * cp_rank,
            0 if mesh is None else mesh.tp_rank,
            rng_device,
        )
        kw = dict(group=group, sequence_parallel=self.sequence_parallel, device=device, dtype=dtype)
        self.layers = build_layers(
            config,
            indices,
            self.rng,
            kw,
            recompute=recompute,
            cp_group=cp_group,
            cp_method=cp_method,
            ep_group=ep_group,
        )
        init_parameters(self, seed)

    @property
    def _has_blocks(self) -> bool:
        return any(0 < i <= self.config.num_layers for i in self.layer_indices)

    def _positions(self, batch: dict, hidden) -> torch.Tensor:
        """``[1, s]`` positions of this rank's tokens when ``position_ids`` is not given: ``0..s-1`` of the
        whole sequence, or under context parallelism those of this rank's chunks."""
        ids = batch.get("input_ids")
        seq = (
            ids.shape[1]
            if ids is not None
            else hidden.shape[1] * (group_size(self.mesh.tp_group) if self.sequence_parallel else 1)
        )
        cp = 1 if self.mesh is None else self.mesh.cp
        if self.config.rope_theta is None and seq * cp > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq * cp} ({seq} on each of cp={cp} ranks) exceeds "
                f"max_position_embeddings ({self.config.max_position_embeddings})"
            )
        device = ids.device if ids is not None else hidden.device
        return context.positions(
            seq * cp, cp, 0 if cp == 1 else self.mesh.cp_rank, device
        ).unsqueeze(0)

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

    def forward(
        self,
        input_ids=None,
        labels=None,
        attention_mask=None,
        position_ids=None,
        token_type_ids=None,
        hidden=None,
        aux_loss_scale=None,
    ):
        batch = {
            k: v
            for k, v in dict(
                input_ids=input_ids,
                labels=labels,
                attention_mask=attention_mask,
                position_ids=position_ids,
                token_type_ids=token_type_ids,
                aux_loss_scale=aux_loss_scale,
            ).items()
            if v is not None
        }
        if "position_ids" not in batch and (
            self.config.rope_theta is not None or self.mesh is not None and self.mesh.cp > 1
        ):
            batch["position_ids"] = self._positions(
                batch, hidden
            )  # learned positions take them too under cp
        if self.config.rope_theta is not None and self._has_blocks:
            batch["rope"] = self._rope_tables(batch, hidden)
        for layer in self.layers.values():
            hidden = layer(hidden, batch)
        return hidden


def logical_shapes(
    config: TransformerConfig, layers: Iterable[int] | None = None
) -> dict[str, tuple[int, ...]]:
    """Parameter name -> logical (whole, unpadded) shape of ``config``'s model, or of only the
    global layer indices ``layers``; built on the meta device, so nothing is allocated. A tied
    output weight built with its embedding appears once (under the embedding's name)."""
    model = TransformerModel(config, layers=layers, device="meta")
    return {
        part.name: tuple(part.spec.logical_shape)
        for n, p in model.named_parameters()
        for part in logical_parts(n, p)
    }
