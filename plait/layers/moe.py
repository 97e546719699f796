"""Mixture-of-experts feed-forward layer: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token.

``MoE`` routes in float32 (Shazeer et al. 2017; ``route``: ``"softmax_topk"`` as Mixtral/Qwen-MoE, or
``"topk_softmax"``), optionally with DeepSeek-V3's auxiliary-loss-free ``expert_bias`` (Wang et al. 2024,
Eq. 3-4; ``update_expert_bias``), dispatches dropless or with ``capacity_factor`` (``dispatch``,
``expert_capacity``; drops counted in ``MoEAux.dropped``), runs the experts as grouped GEMMs
(``grouped_mm``), and adds optional shared experts. Its losses, Switch balance (Fedus et al. 2021, Eq. 4;
``balance_loss``, k when balanced) and router z-loss (Zoph et al. 2022, Eq. 5; ``z_loss``), are returned
in ``MoEAux.loss`` and joined to the gradient at the layer (``add_loss_gradient``).

Shapes: ``x [..., h]`` -> ``[..., h]``; weights ``gate_proj``/``up_proj`` ``[E, ffn, h]``, ``down_proj``
``[E, h, ffn]`` (each expert a ``Linear`` weight, stacked), ``router.weight`` ``[E, h]``. Design notes:
``docs/layers.md``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from plait.layers.linear import replicated_param, sharded_param
from plait.layers.mlp import MLP
from plait.parallel.collectives import group_size
from plait.parallel.experts import expert_parallel, select_rows, stable_order
from plait.parallel.mesh import check_divisible, divisors

ROUTER_ORDERS = ("softmax_topk", "topk_softmax")


class Routing(NamedTuple):
    """The router's decision for ``T`` tokens: ``weights [T, k]`` float32 (combine weights), ``experts [T, k]``
    int64, ``probs [T, E]`` and ``logits [T, E]`` float32."""

    weights: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


class MoEAux(NamedTuple):
    """What a forward leaves besides its output: ``loss`` (``balance_loss_coef x balance + z_loss_coef x z``,
    a scalar in the autograd graph), ``balance`` and ``z`` (detached scalars), ``tokens_per_expert [E]``
    (assignments routed to each expert, before any drop) and ``dropped`` (assignments over capacity)."""

    loss: torch.Tensor
    balance: torch.Tensor
    z: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor


def route(
    logits: torch.Tensor,
    k: int,
    order: str = "softmax_topk",
    normalize: bool = True,
    bias: torch.Tensor | None = None,
) -> Routing:
    """Top-k routing of ``logits [T, E]`` (module docstring); ``bias [E]`` shifts only the selection."""
    logits = logits.float()
    probs = logits.softmax(-1)
    scores = probs if order == "softmax_topk" else logits
    experts = (scores if bias is None else scores + bias).topk(k, dim=-1).indices
    picked = scores.gather(-1, experts)
    if order == "softmax_topk":
        weights = picked / picked.sum(-1, keepdim=True) if normalize else picked
    else:
        weights = picked.softmax(-1)
    return Routing(weights, experts, probs, logits)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert ``[E]`` (int64) of ``experts [T, k]``; a scatter-add, so no host sync (CUDA's
    ``bincount`` reads the maximum back to size its output)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def balance_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss ``E * sum_i f_i P_i`` (module docstring); ``probs [T, E]``,
    ``experts [T, k]``. Differentiable through ``probs`` only."""
    tokens, num_experts = probs.shape
    counts = expert_counts(experts, num_experts).to(probs.dtype)
    return num_experts * torch.sum(counts / tokens * probs.mean(0))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss ``mean_x logsumexp(logits_x)^2`` over ``logits [T, E]``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def expert_capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """``ceil(factor * tokens * k / num_experts)``: the most assignments one expert takes."""
    return math.ceil(factor * tokens * k / num_experts)


def grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool = True
) -> torch.Tensor:
    """``x [M, K]`` whose rows come in ``len(counts)`` consecutive blocks (``counts [E]``, summing to M),
    block e times ``weight[e]^T`` (``weight [E, N, K]``) -> ``[M, N]``. One ``torch._grouped_mm`` where it
    applies (``grouped``; rows 16-byte aligned; on CUDA bf16 on compute capability >= 9), else a matmul per
    block (a host sync for the block sizes)."""
    itemsize = x.element_size()
    aligned = all(n * itemsize % 16 == 0 for n in (x.shape[1], weight.shape[1]))
    cuda_ok = not x.is_cuda or (
        x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )
    if (
        grouped
        and hasattr(torch, "_grouped_mm")
        and aligned
        and cuda_ok
        and x.dtype == weight.dtype
    ):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    blocks = x.split(counts.tolist())
    return torch.cat([block @ weight[e].T for e, block in enumerate(blocks)])


class _AddLossGradient(torch.autograd.Function):
    """Identity on ``y``; its backward also gives ``loss`` the gradient ``scale`` (Megatron-LM's
    ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, y, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def add_loss_gradient(y: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``y`` unchanged; a backward through it adds ``scale x d loss / d theta`` to every gradient, as if
    ``scale x loss`` were added to the loss being differentiated. ``scale`` is d(what the backward
    differentiates)/d(the model's loss): 1 for ``loss.backward()``, ``loss_scale / GAS`` for an engine's
    scaled backward of each micro-batch. ``loss`` a scalar in the autograd graph; ``y`` any tensor whose
    gradient the backward computes (a layer's output)."""
    return _AddLossGradient.apply(y, loss, scale)


def dispatch(experts: torch.Tensor, num_experts: int, capacity: int | None):
    """Assignment slots (of ``experts [T, k]`` flattened) sorted by expert, token order kept within each:
    ``(slots [M], rows_per_expert [E], dropped)``; with ``capacity`` only each expert's first ``capacity``
    slots are kept (``dropped`` counts the rest; 0 without)."""
    flat = experts.reshape(-1)
    slots = stable_order(flat, num_experts)
    counts = expert_counts(flat, num_experts)
    if capacity is None:
        return slots, counts, torch.zeros((), dtype=counts.dtype, device=counts.device)
    starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(flat.numel(), device=flat.device) - starts[flat[slots]]
    kept = counts.clamp(max=capacity)
    return slots[within < capacity], kept, (counts - kept).sum()


def check_routing(
    num_experts: int, top_k: int, router_order: str, capacity_factor: float | None
) -> None:
    """Raises ValueError naming the value: top_k outside ``[1, num_experts]``, an unknown router_order, or a
    capacity_factor <= 0."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    if router_order not in ROUTER_ORDERS:
        raise ValueError(f"unknown router_order {router_order!r}; use one of {ROUTER_ORDERS}")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(
            f"capacity_factor must be > 0 (or None for dropless routing), got {capacity_factor}"
        )


class MoE(nn.Module):
    """Top-k mixture of SwiGLU experts (module docstring). ``forward(x)`` returns ``(y, MoEAux)``.

    Args:
        hidden_size, ffn_hidden_size: model width and each expert's inner width.
        num_experts, top_k: experts and experts per token (``1 <= top_k <= num_experts``).
        router_order: "softmax_topk" or "topk_softmax"; normalize_topk: renormalize the top-k
            probabilities (softmax_topk only).
        capacity_factor: None (dropless) or c > 0 (``expert_capacity``).
        shared_ffn_hidden_size: width of the shared experts' SwiGLU MLP (0: none).
        balance_loss_coef, z_loss_coef: weights of the two losses in ``MoEAux.loss``.
        bias_update_rate: auxiliary-loss-free balancing step ``u`` (0: off; the bias stays 0).
        init_std, output_init_std: normal init of the router and gate/up (and of down, default init_std).
        grouped_gemm: the experts' matmuls as grouped GEMMs (``grouped_mm``); False: one matmul per expert.
        ep_group: the expert-parallel group (``ParallelMesh.ep_group``): its P ranks each hold ``E/P`` of the
            experts (``gate_proj`` etc. ``[E/P, ...]``, their logical tensors still ``[E, ...]``) and exchange
            the assignments by all-to-all (``plait.parallel.experts``); None: every expert here.

    Raises:
        ValueError: top_k outside ``[1, num_experts]``, an unknown router_order, capacity_factor <= 0, or
            num_experts not divisible by the ep group's size.
    """

    #: buffers that are training state: checkpoints hold them (``plait.checkpoint.model_io``)
    checkpointed_buffers = ("expert_bias",)

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        router_order: str = "softmax_topk",
        normalize_topk: bool = True,
        capacity_factor: float | None = None,
        shared_ffn_hidden_size: int = 0,
        balance_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0,
        init_std: float = 0.02,
        output_init_std: float | None = None,
        grouped_gemm: bool = True,
        ep_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        check_routing(num_experts, top_k, router_order, capacity_factor)
        self.num_experts, self.top_k, self.router_order = num_experts, top_k, router_order
        self.normalize_topk, self.capacity_factor = normalize_topk, capacity_factor
        self.balance_loss_coef, self.z_loss_coef = balance_loss_coef, z_loss_coef
        self.bias_update_rate, self.grouped_gemm = bias_update_rate, grouped_gemm
        ep = group_size(ep_group)
        check_divisible(
            num_experts,
            ep,
            "num_experts",
            "the expert-parallel size ep",
            f"choose ep from {divisors(num_experts)}",
        )
        self.ep_group = ep_group if ep > 1 else None
        kw = dict(device=device, dtype=dtype)
        self._build_weights(
            hidden_size, ffn_hidden_size, shared_ffn_hidden_size, init_std, output_init_std, kw
        )
        self.register_buffer(
            "expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
        )
        self.register_buffer(
            "tokens_seen",
            torch.zeros(num_experts, dtype=torch.float32, device=device),
            persistent=False,
        )
        # training forwards since ``take_stats``: tokens per expert [E], then the sums of balance, z, dropped
        # and the forward count; a recomputed forward counts twice, which leaves every ratio unchanged
        self.register_buffer(
            "stats",
            torch.zeros(num_experts + 4, dtype=torch.float32, device=device),
            persistent=False,
        )

    def _build_weights(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        shared_ffn_hidden_size: int,
        init_std: float,
        output_init_std: float | None,
        kw: dict,
    ) -> None:
        """The router ``[E, h]`` (replicated), the experts' SwiGLU weights ``[E(/ep), ...]`` split over the ep
        group, and the shared experts' MLP (None without)."""
        num_experts = self.num_experts
        self.router_weight = replicated_param((num_experts, hidden_size), "normal", init_std, **kw)
        experts = dict(dim=0, group=self.ep_group, kind="normal", axis="ep", **kw)
        self.gate_proj = sharded_param(
            (num_experts, ffn_hidden_size, hidden_size), std=init_std, **experts
        )
        self.up_proj = sharded_param(
            (num_experts, ffn_hidden_size, hidden_size), std=init_std, **experts
        )
        self.down_proj = sharded_param(
            (num_experts, hidden_size, ffn_hidden_size), std=output_init_std or init_std, **experts
        )
        self.shared = (
            MLP(
                hidden_size,
                shared_ffn_hidden_size,
                "swiglu",
                bias=False,
                init_std=init_std,
                output_init_std=output_init_std,
                **kw,
            )
            if shared_ffn_hidden_size
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat.float(), self.router_weight.float())
        bias = self.expert_bias if self.bias_update_rate > 0 else None
        r = route(logits, self.top_k, self.router_order, self.normalize_topk, bias)
        capacity = (
            None
            if self.capacity_factor is None
            else expert_capacity(flat.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        )
        slots, rows, dropped = dispatch(r.experts, self.num_experts, capacity)
        k = self.top_k
        xs = select_rows(flat.unsqueeze(1).expand(-1, k, -1).reshape(-1, flat.shape[-1]), slots)
        out = (
            self._experts(xs, rows)
            if self.ep_group is None
            else expert_parallel(xs, rows, self._experts, self.ep_group)
        )
        out = out * r.weights.reshape(-1)[slots].unsqueeze(-1).to(x.dtype)
        y = flat.new_zeros(flat.shape[0] * k, flat.shape[1]).index_copy(
            0, slots, out
        )  # slot order again
        y = y.view(-1, k, flat.shape[1]).sum(1).view(x.shape)
        if self.shared is not None:
            y = y + self.shared(x)
        counts = expert_counts(r.experts, self.num_experts)
        balance, z = balance_loss(r.probs, r.experts), z_loss(r.logits)
        loss = self.balance_loss_coef * balance + self.z_loss_coef * z
        if self.training and torch.is_grad_enabled():  # not an evaluation forward in train mode
            if self.bias_update_rate > 0:
                self.tokens_seen += counts.float()
            sums = torch.stack([balance.detach(), z.detach(), dropped.float(), torch.ones_like(z)])
            self.stats += torch.cat([counts.float(), sums])
        return y, MoEAux(loss, balance.detach(), z.detach(), counts, dropped)

    def _experts(self, xs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``xs [M, h]``, ``rows [E_here]`` consecutive rows per expert -> ``[M, h]``."""
        g = self.grouped_gemm
        inner = F.silu(grouped_mm(xs, self.gate_proj, rows, g)) * grouped_mm(
            xs, self.up_proj, rows, g
        )
        return grouped_mm(inner, self.down_proj, rows, g)

    @torch.no_grad()
    def take_stats(self) -> torch.Tensor:
        """The training statistics since the last call, ``[E + 4]`` float32: tokens routed to each expert,
        then the sums over forwards of the balance loss, the z-loss and the dropped assignments, then the
        number of forwards; the count restarts."""
        out = self.stats.clone()
        self.stats.zero_()
        return out

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """One step of auxiliary-loss-free balancing from the tokens counted since the last call (summed
        over ``group``, e.g. the data-parallel ranks, when given): ``b_i += u * sign(mean(c) - c_i)``; the
        count restarts. A no-op with ``bias_update_rate`` 0."""
        if self.bias_update_rate <= 0:
            return
        counts = self.tokens_seen
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        self.expert_bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
        counts.zero_()
