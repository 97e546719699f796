"""ZeRO-3's float8 all-gather (``fp8.float8_all_gather``): float8 weights gathered as float8, one byte an element.

The model is torchao's float8 all-gather for FSDP2 (``enable_fsdp_float8_all_gather`` with
``precompute_float8_dynamic_scale_for_fsdp``). Before ZeRO-3 gathers a segment of float8-served weights
(``GroupKey.cast``: the layout keeps them apart), each rank takes the amax of its piece of every weight, one
all-reduce (MAX) over the segment's ranks makes it the amax of the whole logical weight, and each piece is cast
to float8 (e4m3) with that weight's tensorwise scale, exactly as torchao casts the whole weight
(``to_fp8_saturated(w.float() * scale)``, elementwise). The all-gather moves those bytes; the parameter then
stands for its shape only (a one-element stand-in), and ``gathered_weight`` hands the layer torchao's
``Float8TrainingTensor`` over the gathered bytes and that scale, which its matmul uses as it comes (no second
cast). The amax of the whole weight is the one a bf16 gather's layer would take, so every float8 value, the
scale and hence the losses equal the bf16 gather's bit for bit. Parameters, masters, gradients and
checkpoints keep their dtypes; whole-model access (``gathered_parameters``) gathers bf16.

Served: plait's ``Float8ColumnParallelLinear`` / ``Float8RowParallelLinear`` at tensor_parallel.size 1
(``plait.config`` refuses other sizes) and a Hugging Face model's torchao ``Float8Linear`` layers
(``GatheredFloat8Linear``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

if TYPE_CHECKING:
    from plait.zero.flat import Segment

#: on a parameter while ZeRO-3 holds it gathered in float8: ``(data [out, in] float8, scale [] float32)``
GATHERED_ATTR = "_plait_float8_gathered"


@torch.no_grad()
def cast_into(target: torch.Tensor, piece: torch.Tensor, scale: torch.Tensor) -> None:
    """``target`` (float8, ``piece``'s shape) := ``piece`` scaled by ``scale`` (``[]`` float32) and saturated,
    as torchao casts a weight (``to_fp8_saturated(w.float() * scale)``)."""
    target.copy_(to_fp8_saturated(piece.float() * scale, target.dtype))


class _GatheredWeight(torch.autograd.Function):
    """Forward: ``weight``'s gathered float8 ``data`` and ``scale`` as a ``Float8TrainingTensor`` (``weight`` is a
    stand-in of its shape and dtype). Backward: the gradient passes to ``weight`` unchanged, as torchao's casts."""

    @staticmethod
    def forward(ctx, weight, data, scale, linear_mm):
        return Float8TrainingTensor(data, scale, weight.dtype, linear_mm, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def gathered_weight(weight: nn.Parameter, linear_mm) -> torch.Tensor | None:
    """``weight`` (``[out, in]``) as ZeRO-3 gathered it in float8 (a ``Float8TrainingTensor`` of torchao's
    matmul settings ``linear_mm``), or None when it was not (another stage, one rank, whole-model access)."""
    got = getattr(weight, GATHERED_ATTR, None)
    return None if got is None else _GatheredWeight.apply(weight, *got, linear_mm)


class GatheredFloat8Linear(Float8Linear):
    """torchao's ``Float8Linear`` (a Hugging Face model's converted ``nn.Linear``) that computes with its weight
    as ZeRO-3 gathered it in float8 (``gathered_weight``) when it was, as torchao's ``Float8Linear`` does with
    FSDP2's float8 all-gather; otherwise torchao's forward. ``Float8Gather`` gives a model's ``Float8Linear``
    layers this class (as FSDP2's ``fully_shard`` gives modules its own subclass); parameters are kept."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = gathered_weight(self.weight, self.linear_mm_config)
        if weight is None:
            return super().forward(input)
        if torch.is_autocast_enabled():  # as torchao's Float8Linear.forward
            input = input.to(torch.get_autocast_gpu_dtype())
        out = matmul_with_hp_or_float8_args.apply(
            input, weight.t(), self.linear_mm_config, self.config
        )
        return out if self.bias is None else out + self.bias.to(out.dtype)


class Float8Gather:
    """``plait.zero.gather_cast.GatherCast`` for the weights of ``module``'s float8 layers (converted already:
    ``plait.precision.float8.convert_to_float8``): plait's Float8Column/RowParallelLinear, and torchao's
    ``Float8Linear``, whose class becomes ``GatheredFloat8Linear``. A weight another module reads too (an
    output head tied to the embedding) is gathered in its compute dtype: only the float8 layer could read it
    gathered in float8."""

    def __init__(self, module: nn.Module):
        from plait.precision.float8_layers import (
            Float8ColumnParallelLinear,
            Float8RowParallelLinear,
        )

        self.configs, others = {}, set()  # id(weight) -> its layer's torchao Float8LinearConfig
        for m in module.modules():
            if type(m) is Float8Linear:
                m.__class__ = GatheredFloat8Linear
            if isinstance(m, Float8Linear):
                self.configs[id(m.weight)] = m.config
            elif isinstance(m, (Float8ColumnParallelLinear, Float8RowParallelLinear)):
                self.configs[id(m.weight)] = m.fp8_config
            else:
                others.update(id(p) for p in m.parameters(recurse=False))
        self.configs = {k: c for k, c in self.configs.items() if k not in others}
        self.scales: dict[int, torch.Tensor] = {}  # id(weight) -> its scale of the latest narrow
        self.views: dict[
            int, tuple[torch.Tensor, list[torch.Tensor]]
        ] = {}  # id(seg) -> buffer, views
        self.amax_groups: dict = {}  # a gather's group -> the same ranks on a communicator of their own
        # on the GPU: ``cast_into`` compiled, made at the first narrow there (``_cast``)
        self.fused_cast = None

    def casts(self, param: nn.Parameter) -> bool:
        return id(param) in self.configs

    def _dtype(self, param) -> torch.dtype:
        return self.configs[id(param)].cast_config_weight.target_dtype

    def narrow(self, segs: list[Segment], shards: list[torch.Tensor], group) -> list[torch.Tensor]:
        """Cast each weight's piece of ``shards`` with the scale of the whole weight (one all-reduce of the
        pieces' amaxes over ``group``); ``[S]`` uint8 views of float8 out."""
        pieces = []  # (segment index, slot, this rank's piece of it, its start in the shard)
        for i, (seg, shard) in enumerate(zip(segs, shards)):
            lo, hi = seg.lo, seg.lo + seg.shard_size
            for slot in seg.slots:
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                pieces.append((i, slot, shard[a - lo : max(a, b) - lo], a - lo))
        scales = self._scales(pieces, group)
        out = [
            torch.zeros(seg.shard_size, dtype=torch.uint8, device=s.device)
            for seg, s in zip(segs, shards)
        ]
        for (i, slot, piece, start), scale in zip(pieces, scales):
            self.scales[id(slot.param)] = scale
            if piece.numel():
                dtype = self._dtype(slot.param)
                target = out[i].view(dtype)[start : start + piece.numel()]
                self._cast(piece)(target, piece, scale)
        return out

    def _cast(self, piece: torch.Tensor):
        """``cast_into``; on the GPU compiled into one kernel (the piece read, float8 written: 3 bytes an element,
        where the eager ops' fp32 temporaries move 19), the same elementwise arithmetic, so the same bytes."""
        if not piece.is_cuda:
            return cast_into
        if self.fused_cast is None:
            self.fused_cast = torch.compile(cast_into, dynamic=True)
        return self.fused_cast

    def _scales(self, pieces: list, group) -> list[torch.Tensor]:
        """Each piece's weight's tensorwise scale (``[]`` float32 views of one ``[len(pieces)]`` tensor) from the
        amax of the whole weight (``torch._foreach_norm`` of inf order, i.e. max |x| exactly, as torchao's FSDP2
        precompute; all-reduced MAX over ``group``), by torchao's ``amax_to_scale``. Nothing here waits for the
        GPU: no tensor is indexed by a Python list (that copies the index host to device and synchronizes),
        so the host keeps queueing the prefetches ahead of the blocks."""
        held = [p for _, _, p, _ in pieces if p.numel()]
        norms = iter(torch._foreach_norm(held, ord=math.inf) if held else [])
        zero = None if len(held) == len(pieces) else pieces[0][2].new_zeros((), dtype=torch.float32)
        amax = torch.stack([next(norms).float() if p.numel() else zero for _, _, p, _ in pieces])
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self._amax_group(group))
        kinds = [
            (self._dtype(s.param), self.configs[id(s.param)].round_scales_to_power_of_2)
            for _, s, _, _ in pieces
        ]
        per_kind = {kind: amax_to_scale(amax, *kind) for kind in set(kinds)}  # one in practice
        return [per_kind[kind][k] for k, kind in enumerate(kinds)]

    def _amax_group(self, group):
        """``group``'s ranks as a process group of their own for the amax all-reduce (made at the first
        narrow, by those ranks only). On ZeRO's communicator it would queue behind the gathers and the
        gradients' reduce-scatters in flight, and the casts, on the compute stream, would wait for them."""
        group = group if group is not None else dist.group.WORLD
        if group not in self.amax_groups:
            ranks = dist.get_process_group_ranks(group)
            self.amax_groups[group] = dist.new_group(ranks, use_local_synchronization=True)
        return self.amax_groups[group]

    def landed(self, seg: Segment, full: torch.Tensor) -> None:
        """Point each weight of ``seg`` at a one-element stand-in of its shape and attach its float8 view of
        ``full`` with its scale (``GATHERED_ATTR``)."""
        seg.full = full
        cached = self.views.get(id(seg))
        if cached is None or cached[0] is not full:
            # ``.data``: views with a version counter of their own, which the gather into ``full`` for the
            # backward (the same bytes again) does not bump: a compiled graph saves them for its backward,
            # as the bf16 gather's parameters, re-pointed by ``.data``, keep theirs
            f8 = full.data.view(self._dtype(seg.slots[0].param))
            views = [f8[s.offset : s.offset + s.numel].view(s.shape) for s in seg.slots]
            cached = self.views[id(seg)] = (full, views)
        for slot, data in zip(seg.slots, cached[1]):
            slot.param.data = full.new_zeros((), dtype=seg.local.dtype).expand(slot.shape)
            setattr(slot.param, GATHERED_ATTR, (data, self.scales[id(slot.param)]))

    def released(self, seg: Segment) -> None:
        for slot in seg.slots:
            if hasattr(slot.param, GATHERED_ATTR):
                delattr(slot.param, GATHERED_ATTR)
