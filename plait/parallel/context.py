"""Context parallelism: attention over a sequence split across the ``cp`` ranks of a group.

Sharding: the sequence is cut into ``2 cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``
(load-balanced "zigzag", as Megatron-Core and torchtitan; ``shard_sequence``, ``unshard_sequence``,
``positions``). ``s`` must divide by ``2 cp`` (ValueError naming the numbers; pad the batch).

* ``ring_attention`` (Liu et al., "Ring Attention with Blockwise Transformers", 2023): K/V travel round
  the ring, blocks merged by their log-sum-exp (Milakov & Gimelshein 2018; FlashAttention Alg. 1).
* ``all_to_all_attention`` (DeepSpeed-Ulysses, Jacobs et al., 2023): sequence shards of all heads become
  the whole sequence of ``heads / cp`` heads; heads and kv heads must divide by cp.

Shapes: ``q [b, heads, s/cp, d]``, ``k, v [b, kv_heads, s/cp, d]`` (GQA when ``kv_heads < heads``), this
rank's two chunks side by side; the output is shaped as ``q``. ``group`` None (or one rank) is plain
attention. Design: ``docs/context-parallel.md``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.parallel.attention_block import (
    _block_backward,
    _block_forward,
    _cuda_kernel,
    _expand,
    _fold,
    _merge,
)
from plait.parallel.collectives import all_gather_flat, group_size
from plait.parallel.experts import inverse_permutation


# ---- sharding --------------------------------------------------------------------------------------
def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2 cp``) rank ``rank`` holds: ``(rank, 2 cp - 1 - rank)``."""
    return rank, 2 * cp - 1 - rank


def check_sequence(seq: int, cp: int) -> int:
    """Chunk length ``seq / (2 cp)``. Raises ValueError (naming the numbers) when it does not divide."""
    if seq % (2 * cp):
        pad = -seq % (2 * cp)
        raise ValueError(
            f"sequence length {seq} is not a multiple of 2 x cp = {2 * cp} (context parallelism "
            f"splits it into 2 x cp equal chunks); pad each sequence by {pad} tokens (to "
            f"{seq + pad}) or choose a cp that divides it"
        )
    return seq // (2 * cp)


def positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions ``[s/cp]`` of the tokens rank ``rank`` holds (for RoPE and the labels); at cp 1 the
    whole sequence's, of any length."""
    if cp == 1:
        return torch.arange(seq, device=device)
    c = check_sequence(seq, cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, rank)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (``[..., s, ...] -> [..., s/cp, ...]``), a copy."""
    c = check_sequence(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in chunk_ids(cp, rank)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence`` given every rank's shard (``parts[r]``), in natural order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp - 1 - r] = first, second
    return torch.cat(chunks, dim=dim)


def _step_rows(rank: int, source: int, causal: bool, local: int) -> tuple[slice, slice, bool]:
    """``(query rows, key rows, causal?)`` of the one block a ring step computes: this rank's queries
    against rank ``source``'s K/V, both ``local = 2c`` long (two chunks, ``chunk_ids``). Its own K/V: all
    against all, causal when the model is (the two chunks are in sequence order, so the local causal mask is
    the global one). Causal, an earlier rank's K/V: both query chunks see its first chunk whole and its
    second not at all. A later rank's: only the second query chunk sees it, whole. Bidirectional: all."""
    every, c = slice(0, local), local // 2
    if source == rank or not causal:
        return every, every, causal and source == rank
    return (every, slice(0, c), False) if source < rank else (slice(c, local), every, False)


def _shift(t: torch.Tensor, group):
    """Post the send of ``t`` to the next rank of the ring and the receive from the previous one;
    returns ``(requests, received)``."""
    cp, rank = group_size(group), dist.get_rank(group)
    recv = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t, dist.get_global_rank(group, (rank + 1) % cp), group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % cp), group),
    ]
    return dist.batch_isend_irecv(ops), recv


def _arrive(posted) -> torch.Tensor:
    requests, received = posted
    for r in requests:
        r.wait()
    return received


def forward_step(
    q, kv, out, lse, rank: int, source: int, causal: bool, scale: float, keep=None
) -> None:
    """One ring step of the forward: this rank's queries ``q`` (``[b, heads, 2c, d]``, contiguous) against
    the K/V ``kv`` (``[2, b, kv_heads, 2c, d]``) of rank ``source`` (one block, ``_step_rows``), merged into
    ``out``/``lse`` (float32, ``[b, heads, 2c, d]`` / ``[b, heads, 2c]``); ``keep [b, 2c]``: rank ``source``'s
    key padding mask (True: attend), or None."""
    rows, cols, diagonal = _step_rows(rank, source, causal, q.shape[2])
    qr = _rows(q, rows)
    k, v = _block_kv(qr, kv, cols, diagonal, scale, keep)
    part, part_lse = _block_forward(
        qr, k, v, diagonal, scale, None if keep is None else keep[:, cols]
    )
    _merge(out[:, :, rows], lse[:, :, rows], part, part_lse)


def backward_step(
    dout, q, out, lse, kv, dq, dkv, rank: int, source: int, causal: bool, scale: float, keep=None
) -> None:
    """One ring step of the backward: adds the block's gradients into ``dq`` (float32, shaped as ``q``) and
    ``dkv`` (``[2, b, kv_heads, 2c, d]`` float32, the gradients of rank ``source``'s K/V); ``dout``, ``q``,
    ``out``, ``lse`` whole and contiguous; ``keep`` as in ``forward_step``."""
    rows, cols, diagonal = _step_rows(rank, source, causal, q.shape[2])
    d, qr, o, m = (_rows(t, rows) for t in (dout, q, out, lse))
    k, v = _block_kv(qr, kv, cols, diagonal, scale, keep)
    gq, gk, gv = _block_backward(
        d, qr, k, v, o, m, diagonal, scale, None if keep is None else keep[:, cols]
    )
    dq[:, :, rows].add_(gq)
    dkv[0][:, :, cols].add_(_fold(gk.float(), kv.shape[2]))
    dkv[1][:, :, cols].add_(_fold(gv.float(), kv.shape[2]))


def _block_kv(
    q, kv, cols: slice, causal: bool, scale: float, keep
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's K and V (rows ``cols`` of ``kv``), contiguous: with their own kv heads where SDPA's
    kernel for them takes grouped-query attention as it is (cuDNN, flash), else repeated to q's heads."""
    k, v = (t[:, :, cols] for t in kv)
    native = (
        q.is_cuda and keep is None and _cuda_kernel(q, k, v, causal, scale) in ("cudnn", "flash")
    )
    return tuple(t.contiguous() if native else _expand(t, q.shape[1]).contiguous() for t in (k, v))


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Sequence rows ``rows`` (dim 2) of ``t``: ``t`` itself when all, else a contiguous copy."""
    return t if rows.start == 0 and rows.stop == t.shape[2] else t[:, :, rows].contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal: bool, scale: float, keep):
        cp, rank = group_size(group), dist.get_rank(group)
        keeps = None if keep is None else _gather(keep, group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        qc, kv = q.contiguous(), torch.stack([k, v])
        for t in range(cp):
            posted = (
                _shift(kv, group) if t < cp - 1 else None
            )  # next K/V travel while this block computes
            source = (rank - t) % cp
            forward_step(
                qc,
                kv,
                out,
                lse,
                rank,
                source,
                causal,
                scale,
                None if keep is None else keeps[source],
            )
            if posted is not None:
                kv = _arrive(posted)
        out = out.to(q.dtype)
        if keep is not None:  # a sequence of padding only: its rows' gradients are 0, not nan
            lse.masked_fill_(lse == -torch.inf, 0.0)
        ctx.save_for_backward(q, k, v, out, lse, keeps)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, keeps = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp, rank = group_size(group), dist.get_rank(group)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        whole = (dout.contiguous(), q.contiguous(), out, lse)
        travelling = (
            None  # the K/V gradients travel with their K/V, one step behind; after cp moves, home
        )
        for t in range(cp):
            posted = _shift(kv, group) if t < cp - 1 else None
            source = (rank - t) % cp
            dkv = torch.zeros(
                kv.shape, dtype=torch.float32, device=q.device
            )  # this rank's part for source's K/V
            backward_step(
                *whole,
                kv,
                dq,
                dkv,
                rank,
                source,
                causal,
                scale,
                None if keeps is None else keeps[source],
            )
            if (
                travelling is not None
            ):  # the other ranks' part for source's K/V arrived during the blocks
                dkv.add_(_arrive(travelling))
            travelling = _shift(dkv, group)
            if posted is not None:
                kv = _arrive(posted)
        dkv = _arrive(travelling)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _gather(keep: torch.Tensor, group) -> torch.Tensor:
    """Every cp rank's key padding mask ``[cp, b, s/cp]`` (bool) from this rank's ``keep [b, s/cp]``."""
    cp = group_size(group)
    out = torch.empty(
        (cp * keep.shape[0],) + tuple(keep.shape[1:]), dtype=torch.uint8, device=keep.device
    )
    all_gather_flat(out, keep.to(torch.uint8).contiguous(), group=group)
    return out.view((cp,) + tuple(keep.shape)).bool()


def _check_mask(keep, q, causal: bool):
    if keep is None:
        return
    if causal:
        raise ValueError(
            "key_padding_mask is for bidirectional attention (causal=False); a causal model "
            "never attends to the padding at the end of a sequence"
        )
    if tuple(keep.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"key_padding_mask has shape {list(keep.shape)}; it must be [b, s/cp] = "
            f"{[q.shape[0], q.shape[2]]}, this rank's part of the batch's attention_mask"
        )


def ring_attention(
    q,
    k,
    v,
    group,
    causal: bool = True,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's query chunks over the whole sequence's keys (module docstring).
    ``key_padding_mask [b, s/cp]`` (bool, True: attend; this rank's part of the batch's attention mask,
    bidirectional only): every rank's part is all-gathered once (``b x s`` bytes) and each block masks the
    keys of the chunk it sees.

    Raises:
        ValueError: heads not a multiple of kv heads, a local sequence of odd length (two chunks), a key
            padding mask of the wrong shape or with ``causal``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _check_heads(q, k)
    _check_mask(key_padding_mask, q, causal)
    keep = None if key_padding_mask is None else key_padding_mask.bool()
    if group_size(group) == 1:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if keep is None else keep[:, None, None, :],
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    if q.shape[2] % 2:
        raise ValueError(
            f"local sequence length {q.shape[2]} is odd: each cp rank holds two equal chunks "
            "(plait.parallel.context.shard_sequence)"
        )
    return _RingAttention.apply(q, k, v, group, causal, scale, keep)


def _check_heads(q, k) -> None:
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})"
        )


# ---- all-to-all (Ulysses) ---------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into cp parts along ``scatter_dim``, send part ``i`` to rank ``i``, and concatenate
    the received parts (rank order) along ``gather_dim``."""
    cp = group_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all_attention(
    q,
    k,
    v,
    group,
    causal: bool = True,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention with heads scattered and the sequence gathered over the cp group (module docstring).
    ``key_padding_mask [b, s/cp]`` as in ``ring_attention`` (all-gathered into the whole sequence's mask);
    ``dropout_p``: attention dropout, drawn from the caller's RNG state (each rank holds other heads).

    Raises:
        ValueError: heads or kv heads not divisible by cp (the message names the numbers); a key padding
            mask of the wrong shape or with ``causal``.
    """
    cp = group_size(group)
    _check_heads(q, k)
    _check_mask(key_padding_mask, q, causal)
    gqa = q.shape[1] != k.shape[1]
    keep = None if key_padding_mask is None else key_padding_mask.bool()
    if cp == 1:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if keep is None else keep[:, None, None, :],
            dropout_p=dropout_p,
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
        )
    for name, n in (("heads", q.shape[1]), ("kv heads", k.shape[1])):
        if n % cp:
            raise ValueError(
                f"all-to-all context parallelism scatters attention heads over cp ranks: this "
                f"rank's {name} ({n}) do not divide by cp ({cp}); use method 'ring' or a cp that "
                f"divides {n}"
            )
    seq = q.shape[2] * cp
    order = torch.cat(
        [positions(seq, cp, r, q.device) for r in range(cp)]
    )  # gathered slot -> token
    natural = inverse_permutation(order)
    q, k, v = (_AllToAll.apply(t, group, 1, 2).index_select(2, natural) for t in (q, k, v))
    mask = (
        None
        if keep is None
        else unshard_sequence(list(_gather(keep, group).unbind(0)))[:, None, None, :]
    )
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
    )
    return _AllToAll.apply(out.index_select(2, order), group, 2, 1)
