"""Float8 MoE experts through torchao's rowwise float8 grouped GEMM (``torchao.prototype.moe_training``).

``Float8MoE`` is a ``plait.layers.MoE`` whose experts' three grouped GEMMs (gate, up, down) run through
torchao's ``_quantize_then_scaled_grouped_mm`` with its ``Float8TrainingOpConfig`` (rowwise, power-of-two
scales, e4m3, ``torch._scaled_grouped_mm``; the very function torchao's converted expert weights call); no
float8 kernel is written here. Router, shared experts (converted as linears) and routing are the MoE's own;
with expert parallelism the all-to-all is unchanged and the rank's experts run in float8.

torchao's float8 grouped GEMM needs every token group (the rows of one expert) to be a multiple of 16 rows:
its weight-gradient GEMM contracts over the rows and TMA needs 16-byte strides (torchao PR 2678; without it a
device-side assert). ``padded_layout`` places each expert's rows at a 16-row aligned start of a buffer of a
size fixed by the shapes (no host sync), zero rows between; the last group takes the buffer's tail, so no row
is left outside a group (``torch._grouped_mm`` leaves such rows uninitialized: pytorch issue 154557). Zero
rows change no rowwise scale, no per-group column amax and no product.

Where torchao's grouped float8 does not serve, the layer stays in high precision and the conversion says
why once (``experts_refusal``): a recipe other than "rowwise" (torchao's grouped GEMM has only rowwise), a CPU
(Triton casts and ``torch._scaled_grouped_mm`` are CUDA-only: no emulation), a GPU other than compute
capability 9.0 / 10.0 (``torch._scaled_grouped_mm``'s check), a hidden size or expert width not a multiple of
16, weights neither bf16 nor fp32, or ``grouped_gemm=False``.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.layers.moe import MoE
from plait.parallel.experts import select_rows
from plait.precision.float8 import excluded

#: rows per token group that torchao's float8 grouped GEMM needs (16 bytes of float8)
GROUP_ALIGN = 16
#: compute capabilities where ``torch._scaled_grouped_mm`` runs (H100/H200, B200)
GROUPED_FLOAT8_CAPABILITIES = ((9, 0), (10, 0))


class GroupedMM(Protocol):
    """``(x [M, K], weight [E, N, K], ends [E] int32) -> [M, N]``: rows ``ends[e-1]:ends[e]`` of ``x`` times
    ``weight[e]^T``; every group a multiple of ``GROUP_ALIGN`` rows and ``ends[-1] == M``."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor
    ) -> torch.Tensor: ...


class TorchaoFloat8GroupedMM:
    """torchao's differentiable rowwise float8 grouped GEMM (``_quantize_then_scaled_grouped_mm``) under
    ``config``, a ``Float8TrainingOpConfig`` (default: torchao's ``FP8_ROWWISE`` recipe). Output bf16."""

    def __init__(self, config=None):
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig

        self.config = Float8TrainingOpConfig() if config is None else config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

        # B_t [E, K, N] column-major, as torchao and torch._scaled_grouped_mm need it
        w_t = weight.contiguous().transpose(1, 2)
        return _quantize_then_scaled_grouped_mm(x.contiguous(), w_t, self.config, offs=ends)


def padded_layout(rows: torch.Tensor, total: int, align: int = GROUP_ALIGN):
    """Where each of ``total`` rows, sorted by expert (``rows [E]`` int64 per expert), goes in a buffer whose
    groups are multiples of ``align`` rows (module docstring). No host sync.

    Returns:
        ``(dest [total] int64, ends [E] int32, size)``: row i's index in the buffer, each group's end offset
        (the last is ``size``), and the buffer's rows ``ceil((total + E (align - 1)) / align) * align``.
    """
    experts = rows.numel()
    size = -(-(total + experts * (align - 1)) // align) * align
    padded = (rows + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    ends = torch.cat([ends[:-1], ends.new_full((1,), size)])
    expert_of = torch.repeat_interleave(
        torch.arange(experts, device=rows.device), rows, output_size=total
    )
    first = torch.cumsum(rows, 0) - rows
    dest = torch.arange(total, device=rows.device) - first[expert_of] + starts[expert_of]
    return dest, ends.to(torch.int32), size


class Float8MoE(MoE):
    """A ``MoE`` (same parameters, the very tensors of ``moe``; same buffers, shared experts, names, ep group)
    whose experts' GEMMs run through ``grouped_mm`` on the padded layout (``padded_layout``).

    Args:
        moe: the layer to convert; its parameters, buffers and shared MLP move to the new layer.
        grouped_mm: the grouped GEMM (``GroupedMM``); default torchao's rowwise float8 one.
    """

    def __init__(self, moe: MoE, grouped_mm: GroupedMM | None = None):
        _, ffn, hidden = moe.gate_proj.shape
        super().__init__(
            hidden,
            ffn,
            moe.num_experts,
            moe.top_k,
            router_order=moe.router_order,
            normalize_topk=moe.normalize_topk,
            capacity_factor=moe.capacity_factor,
            balance_loss_coef=moe.balance_loss_coef,
            z_loss_coef=moe.z_loss_coef,
            bias_update_rate=moe.bias_update_rate,
            grouped_gemm=moe.grouped_gemm,
            ep_group=moe.ep_group,
            device="meta",
            dtype=moe.gate_proj.dtype,
        )
        for name in ("router_weight", "gate_proj", "up_proj", "down_proj"):
            setattr(self, name, getattr(moe, name))
        for name in ("expert_bias", "tokens_seen", "stats"):
            setattr(self, name, getattr(moe, name))
        self.shared = moe.shared
        self.grouped_mm = TorchaoFloat8GroupedMM() if grouped_mm is None else grouped_mm
        self.train(moe.training)

    def _experts(self, xs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``xs [M, h]``, ``rows [E_here]`` consecutive rows per expert -> ``[M, h]``."""
        dest, ends, size = padded_layout(rows, xs.shape[0])
        padded = xs.new_zeros(size, xs.shape[1]).index_copy(0, dest, xs)
        mm = self.grouped_mm
        inner = F.silu(mm(padded, self.gate_proj, ends)) * mm(padded, self.up_proj, ends)
        return select_rows(mm(inner, self.down_proj, ends), dest).to(xs.dtype)


def experts_refusal(
    moe: MoE, recipe: str, device_type: str, capability=None, device_name: str = ""
) -> str | None:
    """Why torchao's float8 grouped GEMM does not serve ``moe``'s experts here (module docstring), or None."""
    if recipe != "rowwise":
        return (
            f"fp8.recipe {recipe!r}: torchao's float8 grouped GEMM scales rowwise only (set fp8.recipe "
            '"rowwise" to run them in float8)'
        )
    if device_type != "cuda":
        return (
            f"torchao's float8 grouped GEMM runs on CUDA GPUs only, not on {device_type!r} (Triton casts "
            "and torch._scaled_grouped_mm; it has no emulation)"
        )
    if capability is not None and tuple(capability) not in GROUPED_FLOAT8_CAPABILITIES:
        return (
            f"{device_name or 'this GPU'} (compute capability {capability[0]}.{capability[1]}): "
            "torch._scaled_grouped_mm runs on compute capability 9.0 and 10.0 only (H100/H200, B200)"
        )
    try:  # a prototype API of torchao: another version may have moved it
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: F401
        from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm  # noqa: F401
    except ImportError as err:
        return f"this torchao has no rowwise float8 grouped GEMM where torchao 0.18 had it ({err})"
    if not moe.grouped_gemm:
        return "grouped_gemm=False (torchao's float8 path is a grouped GEMM)"
    _, ffn, hidden = moe.gate_proj.shape
    if hidden % GROUP_ALIGN or ffn % GROUP_ALIGN:
        return f"hidden size {hidden} or expert width {ffn} is not a multiple of 16"
    if moe.gate_proj.dtype not in (torch.bfloat16, torch.float32):
        return (
            f"expert weights in {moe.gate_proj.dtype} (torchao's grouped GEMM takes bf16 or fp32)"
        )
    return None


class ExpertsReport(NamedTuple):
    """Each MoE layer's verdict: ``converted`` names, ``excluded`` names (by ``fp8.exclude``), ``kept`` {name:
    reason} left in high precision; ``matched`` the exclude patterns that named one."""

    converted: list
    excluded: list
    kept: dict
    matched: set


def convert_moe_experts(
    module: nn.Module, fp8, device_type: str, capability=None, device_name: str = ""
) -> ExpertsReport:
    """Swap, in place, every ``MoE`` of ``module`` that ``fp8.exclude`` (an ``FP8Config``'s) does not name and
    torchao's float8 grouped GEMM serves (``experts_refusal``) for a ``Float8MoE``; log the verdicts once
    (rank 0) when the model has MoE layers."""
    report = ExpertsReport([], [], {}, set())
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if not isinstance(sub, MoE) or isinstance(sub, Float8MoE):
                continue
            full = f"{name}.{attr}" if name else attr
            pattern = excluded(full, fp8.exclude)
            reason = experts_refusal(sub, fp8.recipe, device_type, capability, device_name)
            if pattern is not None:
                report.excluded.append(full)
                report.matched.add(pattern)
            elif reason is not None:
                report.kept[full] = reason
            else:
                setattr(child, attr, Float8MoE(sub))
                report.converted.append(full)
    _log(report)
    return report


def _log(report: ExpertsReport) -> None:
    """One line (rank 0): how many MoE layers run their experts in float8, how many are excluded, and each
    reason for the rest."""
    total = len(report.converted) + len(report.excluded) + len(report.kept)
    if not total or (dist.is_initialized() and dist.get_rank() != 0):
        return
    reasons: dict[str, list[str]] = {}
    for name, reason in report.kept.items():
        reasons.setdefault(reason, []).append(name)
    kept = "; ".join(
        f"{r} ({', '.join(names[:3])}{'...' if len(names) > 3 else ''})"
        for r, names in reasons.items()
    )
    logging.getLogger("plait").warning(
        "fp8: %d MoE layer(s) run their experts in float8 (torchao's rowwise float8 grouped GEMM, token "
        "groups padded to 16 rows); %d excluded by fp8.exclude; %d left in high precision%s",
        len(report.converted),
        len(report.excluded),
        len(report.kept),
        f": {kept}" if kept else "",
    )
