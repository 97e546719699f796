"""Column- and row-parallel linear layers (Shoeybi et al., "Megatron-LM", 2019, Sec. 3, Eq. 2-3).

A ``ColumnParallelLinear`` splits the output features over tp (weight ``[out/tp, in]``);
a ``RowParallelLinear`` splits the input features (weight ``[out, in/tp]``) and sums the
partial outputs. A column layer followed by a row layer (attention, MLP) needs one
collective forward and one backward. With ``sequence_parallel`` the replicated input is
instead a sequence shard ``[b, s/tp, h]``: the column layer all-gathers it and the row
layer reduce-scatters its output (Korthikanti et al., 2022, Sec. 4.2.2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.layers.init import set_init
from plait.parallel.collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from plait.parallel.sharding import FusedShard, TPShard, mark


def divide(value: int, tp: int, what: str) -> int:
    """``value // tp``, or ValueError naming both numbers and the valid tp sizes."""
    if value % tp:
        valid = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
        raise ValueError(
            f"{what} ({value}) is not divisible by the tensor-parallel size tp={tp}; "
            f"choose tp from {valid} or change {what}"
        )
    return value // tp


def enter_tp_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Make a replicated (or, with sequence parallelism, sequence-sharded ``[b, s/tp, h]``) input
    ready for column-parallel matmuls: copy-to-tp (all-reduce in backward) or sequence all-gather
    (reduce-scatter in backward). Call once when several column layers share one input."""
    return gather_from_sp(x, group) if sequence_parallel else copy_to_tp(x, group)


def leave_tp_region(y: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Sum row-parallel partial outputs: all-reduce, or reduce-scatter to ``[b, s/tp, h]``."""
    return reduce_scatter_to_sp(y, group) if sequence_parallel else reduce_from_tp(y, group)


def _new_param(spec: TPShard | FusedShard, kind: str, std: float, device, dtype) -> nn.Parameter:
    """An uninitialized parameter of ``spec``'s local shape, marked with ``spec``, initializer declared."""
    p = nn.Parameter(torch.empty(spec.local_shape, device=device, dtype=dtype))
    return set_init(mark(p, spec), kind, std)


def replicated_param(
    shape: tuple[int, ...], kind: str, std: float = 0.0, device=None, dtype=None
) -> nn.Parameter:
    """A parameter every tp rank holds whole (norm weights, row-parallel bias)."""
    return _new_param(TPShard(tuple(shape)), kind, std, device, dtype)


def sharded_param(
    logical_shape: tuple[int, ...],
    dim: int,
    group,
    kind: str,
    std: float = 0.0,
    padded: int | None = None,
    device=None,
    dtype=None,
    axis: str = "tp",
) -> nn.Parameter:
    """A parameter split along ``dim`` over ``group``, the tp group (or the ep group with ``axis="ep"``),
    padded to ``padded`` rows if given."""
    spec = TPShard(tuple(logical_shape), dim, padded, group_rank(group), group_size(group), axis)
    return _new_param(spec, kind, std, device, dtype)


def fused_param(
    names: tuple[str, ...],
    logical_shapes: list[tuple[int, ...]],
    group,
    kind: str,
    std: float = 0.0,
    device=None,
    dtype=None,
) -> nn.Parameter:
    """One parameter holding the tp shards (split along dim 0) of the logical tensors ``names``,
    stacked along dim 0 in that order (``FusedShard``); initialized part by part under their names."""
    parts = tuple(
        TPShard(tuple(shape), 0, None, group_rank(group), group_size(group))
        for shape in logical_shapes
    )
    return _new_param(FusedShard(tuple(names), parts), kind, std, device, dtype)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by output rows over tp.

    A fused layer (``out_features`` a tuple, ``parts`` the logical layers' names) runs several
    column-parallel layers sharing one input as one matmul (q/k/v; SwiGLU's gate and up): each rank
    holds its rows of every part side by side (``FusedShard``), and ``split`` cuts the output into
    the parts' ``[..., out_i/tp]``. Checkpoints, initialization and conversion see the parts'
    logical tensors (``q_proj.weight``...), so fused and unfused models share checkpoints.

    Args:
        in_features, out_features: logical sizes; ``out_features`` (each part's, if a tuple) must
            divide by tp.
        parts: with a tuple ``out_features``, the module names of the logical layers it fuses.
        bias: add a bias (split like the output).
        gather_output: all-gather the output to ``[..., out]``; else return ``[..., out/tp]``.
        sequence_parallel: input is ``[b, s/tp, in]``; all-gather it along seq first.
        group: tp process group (None: one process). init_std: weight init std.

    Shapes: input ``[b, s, in]`` (``[b, s/tp, in]`` with sequence_parallel), output
    ``[b, s, out/tp]`` (``[b, s, out]`` with gather_output); fused: ``[b, s, sum(out_i)/tp]``.

    Raises:
        ValueError: an ``out_features`` not divisible by tp (names it and the valid tp sizes);
            ``parts`` not one name per entry of a tuple ``out_features``, or a fused layer with
            ``gather_output``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | tuple[int, ...],
        bias: bool = True,
        *,
        group=None,
        parts: tuple[str, ...] | None = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = group_size(group)
        fused = isinstance(out_features, (tuple, list))
        sizes = tuple(out_features) if fused else (out_features,)
        if fused != (parts is not None) or (fused and (len(parts) != len(sizes) or gather_output)):
            raise ValueError(
                f"a fused ColumnParallelLinear takes one name in parts per entry of out_features "
                f"and no gather_output; got out_features={out_features}, parts={parts}"
            )
        names = [f"out_features of {name}" for name in parts] if fused else ["out_features"]
        self.local_sizes = [divide(n, tp, what) for n, what in zip(sizes, names)]
        self.group, self.gather_output, self.sequence_parallel = (
            group,
            gather_output,
            sequence_parallel,
        )
        self.in_features, self.out_features, self.parts = in_features, out_features, parts
        kw = dict(device=device, dtype=dtype)
        if parts is None:
            self.weight = sharded_param(
                (out_features, in_features), 0, group, "normal", init_std, **kw
            )
            self.bias = sharded_param((out_features,), 0, group, "zeros", **kw) if bias else None
        else:
            self.weight = fused_param(
                parts, [(n, in_features) for n in sizes], group, "normal", init_std, **kw
            )
            self.bias = (
                fused_param(parts, [(n,) for n in sizes], group, "zeros", **kw) if bias else None
            )

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A fused layer's local output ``[..., sum(out_i)/tp]`` as the parts' ``[..., out_i/tp]`` (views)."""
        return y.split(self.local_sizes, dim=-1)

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x A^T + b`` on this rank's shard: ``[..., in]`` -> ``[..., out/tp]`` (a float8 subclass,
        ``plait.precision.float8``, replaces this alone)."""
        return F.linear(x, self.weight, self.bias)

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The matmul alone, for an input already made ready by ``enter_tp_region``."""
        y = self.local_matmul(x)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local_forward(enter_tp_region(x, self.group, self.sequence_parallel))

    def extra_repr(self) -> str:
        fused = f", parts={self.parts}" if self.parts else ""
        return (
            f"in={self.in_features}, out={self.out_features}{fused}, tp={group_size(self.group)}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by input columns over tp; partial sums reduced.

    Args:
        in_features, out_features: logical sizes; ``in_features`` must divide by tp.
        bias: add a (replicated) bias after the reduction.
        input_is_parallel: input is already ``[..., in/tp]`` (a column layer's output); else it is
            replicated ``[..., in]`` and this rank takes its chunk.
        sequence_parallel: reduce-scatter the output to ``[b, s/tp, out]`` instead of all-reducing.

    Shapes: input ``[b, s, in/tp]``, output ``[b, s, out]`` (``[b, s/tp, out]`` with
    sequence_parallel).

    Raises:
        ValueError: ``in_features`` not divisible by tp.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group=None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        divide(in_features, group_size(group), "in_features")
        self.group, self.input_is_parallel, self.sequence_parallel = (
            group,
            input_is_parallel,
            sequence_parallel,
        )
        self.in_features, self.out_features = in_features, out_features
        self.weight = sharded_param(
            (out_features, in_features), 1, group, "normal", init_std, device=device, dtype=dtype
        )
        self.bias = (
            replicated_param((out_features,), "zeros", device=device, dtype=dtype) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = leave_tp_region(self.local_matmul(x), self.group, self.sequence_parallel)
        if self.bias is None:
            return y
        # Under sequence parallelism each rank adds the bias to its own rows only: sum its grad over tp.
        bias = copy_to_tp(self.bias, self.group) if self.sequence_parallel else self.bias
        return y + bias

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x A^T`` on this rank's shard, the partial sum before the reduction: ``[..., in/tp]`` ->
        ``[..., out]`` (a float8 subclass, ``plait.precision.float8``, replaces this alone)."""
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, tp={group_size(self.group)}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class ReplicatedLinear(nn.Module):
    """A linear layer every tp rank holds whole (e.g. BERT's MLM-head transform).

    With ``sequence_parallel`` the input is a sequence shard ``[b, s/tp, in]`` and each rank's
    weight gradient is partial, so the weights pass through ``copy_to_tp`` (grads summed over tp).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group=None,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = replicated_param(
            (out_features, in_features), "normal", init_std, device, dtype
        )
        self.bias = (
            replicated_param((out_features,), "zeros", device=device, dtype=dtype) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight = copy_to_tp(weight, self.group)
            bias = None if bias is None else copy_to_tp(bias, self.group)
        return F.linear(x, weight, bias)
