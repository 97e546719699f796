"""Expert parallelism: a mixture-of-experts layer's experts split over the ``ep`` ranks (``ParallelMesh.ep``),
each token's assignments sent to the rank holding their expert and the results sent back, by all-to-all with
variable split sizes (GShard, Lepikhin et al., 2020, Sec. 2.2; the token dispatcher of Megatron-Core).

With ``P`` ep ranks and ``E`` experts, ep rank ``j`` holds experts ``[j*E/P, (j+1)*E/P)``. A rank's
assignments, sorted by expert (``plait.layers.moe.dispatch``), are already grouped by destination rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.parallel.collectives import group_size


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of the rows of ``x``: ``in_splits[j]`` rows to rank j, ``out_splits[j]`` from it;
    the backward sends the gradient rows back the same way (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


class _SelectRows(torch.autograd.Function):
    """``x.index_select(0, index)`` for an ``index`` without repeats, whose backward scatters the gradient
    rows back by copy (rows never selected get 0) instead of autograd's accumulating ``index_add``, which
    needs atomics on a GPU."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.new_zeros((ctx.rows,) + tuple(grad.shape[1:])).index_copy_(0, index, grad), None


def select_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` (``index`` without repeats, e.g. a permutation); gradient rows of rows
    never selected are 0."""
    return _SelectRows.apply(x, index)


def stable_order(ids: torch.Tensor, bound: int) -> torch.Tensor:
    """``torch.argsort(ids, stable=True)`` of integer ``ids`` in ``[0, bound)``, sorted as the narrowest of
    int16 / int32 that holds ``bound`` (else ``ids``' own dtype): a GPU radix sort makes one pass per key
    byte, so int64 ids of a few experts took 8 passes where 2 do. Ids outside ``[0, bound)`` are not checked
    (that would cost a host sync). Returns int64 ``[N]``."""
    key = next((t for t in (torch.int16, torch.int32) if bound <= torch.iinfo(t).max), ids.dtype)
    return torch.argsort(ids.to(key), stable=True)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i`` (equal to ``torch.argsort(order)`` for a permutation ``order [N]``)
    by one scatter instead of a sort."""
    return torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    )


def expert_parallel(xs: torch.Tensor, rows: torch.Tensor, experts, group) -> torch.Tensor:
    """Run this rank's assignments ``xs [M, h]`` (sorted by expert; ``rows [E]`` of them per expert) through
    experts held across the ep ``group``: ``experts(x_local [N, h], rows_local [E/P]) -> [N, h_out]`` runs this
    rank's experts on the rows every rank sent them, sorted by expert. Returns ``[M, h_out]`` in the order of
    ``xs``. Collective over ``group`` (two all-to-alls forward, two backward, and one of the ``[E]`` counts,
    whose sizes the host reads: one device sync).
    """
    ranks = group_size(group)
    send = rows.view(ranks, -1)  # [P, E/P]: my assignments per rank, per its expert
    recv = torch.empty_like(send)
    dist.all_to_all_single(
        recv, send.contiguous(), group=group
    )  # [P, E/P]: what each rank sends my experts
    sizes = torch.stack([send.sum(1), recv.sum(1)]).tolist()
    send_sizes, recv_sizes = sizes[0], sizes[1]
    got = _AllToAll.apply(xs, recv_sizes, send_sizes, group)  # rows by (source rank, my expert)
    local = send.shape[1]
    expert_of = (
        torch.arange(local, device=xs.device)
        .repeat(ranks)
        .repeat_interleave(recv.reshape(-1), output_size=sum(recv_sizes))
    )
    order = stable_order(expert_of, local)  # by my expert, then by source rank
    out = experts(select_rows(got, order), recv.sum(0))
    back = select_rows(out, inverse_permutation(order))  # (source rank, my expert) order again
    return _AllToAll.apply(back, send_sizes, recv_sizes, group)
