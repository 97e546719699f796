"""Float8 versions of plait's tensor-parallel linear layers, through torchao's float8 training.

``Float8ColumnParallelLinear`` and ``Float8RowParallelLinear`` keep their parameters, names and tp
sharding and compute the local matmul with torchao's ``matmul_with_hp_or_float8_args`` (``torch._scaled_mm``,
or torchao's emulation on a CPU); no float8 kernel is written here. Every tp-sharded operand is cast by
``cast_global`` with its amax all-reduced (MAX) over the tp group, so each element rounds to the same
float8 value as at tp=1 (column products equal tp=1's; row partial sums differ by float32 summation
order only). Tensorwise scaling only: rowwise recipes run at tp 1 (``plait.config`` refuses them).
Why and which operands: ``docs/kernels.md``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import (
    GemmInputRole,
    LinearMMConfig,
    ScaledMMConfig,
    hp_tensor_and_scale_to_float8,
)
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

from plait.layers.linear import ColumnParallelLinear, RowParallelLinear
from plait.parallel.collectives import group_size
from plait.precision.float8_gather import gathered_weight

_TP_GROUP = object()  # default of ``amax_group``: the layer's own tp group


def mm_config(config: Float8LinearConfig) -> LinearMMConfig:
    """The scaled-matmul settings of torchao's ``Float8Linear`` for ``config`` (output, grad_input,
    grad_weight gemms)."""

    def one(gemm) -> ScaledMMConfig:
        return ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)

    return LinearMMConfig(
        one(config.gemm_config_output),
        one(config.gemm_config_grad_input),
        one(config.gemm_config_grad_weight),
    )


def cast_global(
    x: torch.Tensor,
    dtype: torch.dtype,
    linear_mm: LinearMMConfig,
    role: GemmInputRole,
    group,
    round_pow2: bool = False,
):
    """``x`` as a torchao float8 tensor scaled tensorwise by the amax of the whole logical tensor: this shard's
    amax all-reduced (MAX) over ``group`` (None: this shard's own). Differentiable: the gradient passes to ``x``
    unchanged, as torchao's casts."""
    amax = tensor_to_amax(x).float()
    if group is not None and group_size(group) > 1:
        amax = amax.detach().clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = amax_to_scale(amax, dtype, round_scales_to_power_of_2=round_pow2)
    return hp_tensor_and_scale_to_float8(x, scale, dtype, linear_mm, role)


class _GradToFloat8(torch.autograd.Function):
    """Forward: identity. Backward: the output gradient cast to float8 with the tp-global amax, so torchao's
    matmul backward uses it as it comes (torchao's ``NoopFwToFloat8BwDynamic`` with a tp-wide amax)."""

    @staticmethod
    def forward(ctx, y, config: Float8LinearConfig, linear_mm: LinearMMConfig, group):
        ctx.config, ctx.linear_mm, ctx.group = config, linear_mm, group
        return y

    @staticmethod
    def backward(ctx, grad):
        c = ctx.config
        fp8 = cast_global(
            grad,
            c.cast_config_grad_output.target_dtype,
            ctx.linear_mm,
            GemmInputRole.GRAD_OUTPUT,
            ctx.group,
            c.round_scales_to_power_of_2,
        )
        return fp8, None, None, None


class _Float8Matmul:
    """What both float8 layers share: the torchao config, its matmul settings and the amax group."""

    def _setup(self, config: Float8LinearConfig, amax_group) -> None:
        self.fp8_config, self.linear_mm = config, mm_config(config)
        self.amax_group = self.group if amax_group is _TP_GROUP else amax_group
        self.sharded = group_size(self.group) > 1

    def _cast(self, x: torch.Tensor, role: GemmInputRole):
        c = self.fp8_config
        dtype = (
            c.cast_config_weight if role is GemmInputRole.WEIGHT else c.cast_config_input
        ).target_dtype
        return cast_global(
            x, dtype, self.linear_mm, role, self.amax_group, c.round_scales_to_power_of_2
        )

    def _weight_t(self, cast: bool):
        """The weight operand ``[in, out]``: as ZeRO-3 gathered it in float8 (``fp8.float8_all_gather``),
        else cast here with the tp-global amax (``cast``) or left to torchao's matmul to cast."""
        gathered = gathered_weight(self.weight, self.linear_mm)
        if gathered is not None:
            return gathered.t()
        return self._cast(self.weight.t(), GemmInputRole.WEIGHT) if cast else self.weight.t()

    def _mm(self, x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        return matmul_with_hp_or_float8_args.apply(x, weight_t, self.linear_mm, self.fp8_config)


class Float8ColumnParallelLinear(_Float8Matmul, ColumnParallelLinear):
    """A ``ColumnParallelLinear`` (fused or not) whose local matmul runs in float8; same parameters (the very
    tensors of ``linear``), names, shapes ``[b, s, in] -> [b, s, out/tp]`` and collectives.

    Args:
        linear: the layer to convert; its parameters move to the new layer.
        config: torchao's ``Float8LinearConfig`` (tensorwise when ``linear``'s tp group has more than one rank).
        amax_group: the group over which a sharded operand's amax is taken; default the layer's tp group.
            None scales each shard by its own amax (differs from tp=1; for tests that show the difference).
    """

    def __init__(
        self, linear: ColumnParallelLinear, config: Float8LinearConfig, *, amax_group=_TP_GROUP
    ):
        sizes = linear.out_features
        super().__init__(
            linear.in_features,
            tuple(sizes) if linear.parts else sizes,
            linear.bias is not None,
            group=linear.group,
            parts=linear.parts,
            gather_output=linear.gather_output,
            sequence_parallel=linear.sequence_parallel,
            device="meta",
            dtype=linear.weight.dtype,
        )
        self.weight, self.bias = linear.weight, linear.bias
        self._setup(config, amax_group)

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.sharded
        ):  # x is whole (replicated or all-gathered); the weight and the output gradient are not
            y = _GradToFloat8.apply(
                self._mm(x, self._weight_t(cast=True)),
                self.fp8_config,
                self.linear_mm,
                self.amax_group,
            )
        else:
            y = self._mm(x, self._weight_t(cast=False))
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Float8RowParallelLinear(_Float8Matmul, RowParallelLinear):
    """A ``RowParallelLinear`` whose local matmul (the partial sum before the reduction) runs in float8; same
    parameters, names, shapes ``[b, s, in/tp] -> [b, s, out]`` and collectives. Args as
    ``Float8ColumnParallelLinear``'s."""

    def __init__(
        self, linear: RowParallelLinear, config: Float8LinearConfig, *, amax_group=_TP_GROUP
    ):
        super().__init__(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group=linear.group,
            input_is_parallel=linear.input_is_parallel,
            sequence_parallel=linear.sequence_parallel,
            device="meta",
            dtype=linear.weight.dtype,
        )
        self.weight, self.bias = linear.weight, linear.bias
        self._setup(config, amax_group)

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.sharded
        ):  # the input and the weight are shards; the output gradient is whole on every rank
            return self._mm(self._cast(x, GemmInputRole.INPUT), self._weight_t(cast=True))
        return self._mm(x, self._weight_t(cast=False))
