"""Model-state memory per GPU and per host for ZeRO stages 0-3, with and without CPU offload
(Rajbhandari et al., SC'20, Sec. 3.1 and Fig. 1; ZeRO-Offload, Ren et al., USENIX ATC'21, Sec. 3-4).

Bytes for Psi parameters, N dp ranks, mixed-precision Adam (K = 12 bytes of fp32 state per parameter;
``optimizer_states`` generalises: K = 4 * states + 4)::

    stage 0: (2 + 2 + K) * Psi     stage 1: (2 + 2) * Psi + K * Psi / N
    stage 2: 2 * Psi + (2 + K) * Psi / N     stage 3: (2 + 2 + K) * Psi / N

``accounting="plait"`` counts what ``ZeroOptimizer`` holds instead (an fp32 gradient partition);
offload moves the partitioned states (and with ``offload_param`` the weights) to the host. Not counted:
activations, buckets, fragmentation. Entry points: ``estimate_model_state_memory``,
``estimate_all_stages``, ``estimate_for_model``, ``format_memory_table``, ``held_bytes`` (measured).
Derivation and exceptions: ``docs/zero.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class MemoryBreakdown:
    """Model-state bytes in one place (one GPU, or one host): weights, gradients, optimizer states."""

    params: int
    grads: int
    optimizer_states: int

    @property
    def total(self) -> int:
        """params + grads + optimizer_states, in bytes."""
        return self.params + self.grads + self.optimizer_states


@dataclass(frozen=True)
class MemoryEstimate:
    """Result of :func:`estimate_model_state_memory`: the inputs, bytes per GPU and bytes per host (CPU)."""

    num_params: int
    dp_size: int
    stage: int
    offload_optimizer: bool
    offload_param: bool
    mixed_precision: bool
    num_gpus_per_node: int
    gpu: MemoryBreakdown
    cpu: MemoryBreakdown

    @property
    def offload(self) -> str:
        """Short label: "-", "opt" or "opt+param"."""
        return "opt+param" if self.offload_param else "opt" if self.offload_optimizer else "-"


def estimate_model_state_memory(
    num_params: int,
    dp_size: int,
    stage: int,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    mixed_precision: bool = True,
    num_gpus_per_node: int = 8,
    optimizer_states: int = 2,
    largest_layer_params: int = 0,
    accounting: str = "paper",
) -> MemoryEstimate:
    """Bytes of weights, gradients and optimizer states per GPU and per host (formulas in the module doc).

    Args:
        num_params: parameters Psi of the model (of one model-parallel rank when tp/pp > 1).
        dp_size: data-parallel ranks N that ZeRO partitions over.
        stage: ZeRO stage 0-3.
        offload_optimizer: optimizer states and gradient partition on the host (stage >= 1).
        offload_param: weight partition on the host too (stage 3 only).
        mixed_precision: True for fp16/bf16 weights and grads + fp32 master (2 + 2 + K), False for fp32.
        num_gpus_per_node: GPUs per host; the host holds the offloaded state of ``min(this, dp_size)`` ranks.
        optimizer_states: fp32 state tensors per parameter (Adam/AdamW/LAMB 2; Lion, SGD-momentum 1).
        largest_layer_params: stage 3 only: parameters of the largest layer, whose full weights and
            gradients are gathered on every GPU while it runs (0 = not counted, as in the paper).
        accounting: "paper" (the ZeRO paper's formulas) or "plait" (fp32 gradient partitions, as plait's
            ZeroOptimizer holds them; ``docs/zero.md``).

    Returns:
        MemoryEstimate with ``gpu`` (bytes on one GPU) and ``cpu`` (bytes on one host) breakdowns.

    Raises:
        ValueError: negative sizes, dp_size < 1, stage outside 0..3, offload_optimizer with stage 0,
            offload_param without stage 3.
    """
    gpu, host = _placed_bytes(
        num_params,
        dp_size,
        stage,
        offload_optimizer,
        offload_param,
        mixed_precision,
        num_gpus_per_node,
        optimizer_states,
        largest_layer_params,
        accounting,
    )
    ranks_per_host = min(num_gpus_per_node, dp_size)
    return MemoryEstimate(
        num_params=num_params,
        dp_size=dp_size,
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        mixed_precision=mixed_precision,
        num_gpus_per_node=num_gpus_per_node,
        gpu=MemoryBreakdown(*gpu),
        cpu=MemoryBreakdown(*(b * ranks_per_host for b in host)),
    )


def _placed_bytes(
    num_params,
    dp_size,
    stage,
    offload_optimizer,
    offload_param,
    mixed_precision,
    num_gpus_per_node,
    optimizer_states,
    largest_layer_params,
    accounting,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """((params, grads, optimizer states) bytes on one GPU, the same on the host for one rank), after checking
    the arguments (:func:`_check`)."""
    _check(
        num_params,
        dp_size,
        stage,
        offload_optimizer,
        offload_param,
        num_gpus_per_node,
        optimizer_states,
        largest_layer_params,
    )
    low = 2 if mixed_precision else 4  # bytes per weight / gradient element
    k_gpu = 4 * optimizer_states + (4 if mixed_precision else 0)
    k_host = 4 * optimizer_states + 4  # the host step needs an fp32 master copy
    full, part = num_params, math.ceil(num_params / dp_size)

    if accounting not in ("paper", "plait"):
        raise ValueError(f"accounting must be 'paper' or 'plait', got {accounting!r}")
    gpu_params = (part if stage == 3 else full) * low
    gpu_grads = (part if stage >= 2 else full) * low
    if accounting == "plait" and stage >= 1:
        gpu_grads = part * 4 + (full * low if stage == 1 else 0)
    if accounting == "plait" and stage == 3 and not offload_optimizer:
        gpu_params = 0  # cast from the fp32 master at each gather
    gpu_optim = (part if stage >= 1 else full) * k_gpu
    host_params = host_grads = host_optim = 0
    if offload_optimizer:
        gpu_optim, host_optim = 0, part * k_host
        host_grads = part * low
        gpu_grads = full * low if stage == 1 else 0
    if offload_param:
        gpu_params, host_params = 0, part * low
    if stage == 3:
        gpu_params += largest_layer_params * low
        gpu_grads += largest_layer_params * low
    return (gpu_params, gpu_grads, gpu_optim), (host_params, host_grads, host_optim)


def _check(
    num_params,
    dp_size,
    stage,
    offload_optimizer,
    offload_param,
    num_gpus_per_node,
    optimizer_states,
    largest_layer_params,
) -> None:
    for name, value, low in (
        ("num_params", num_params, 0),
        ("dp_size", dp_size, 1),
        ("num_gpus_per_node", num_gpus_per_node, 1),
        ("optimizer_states", optimizer_states, 0),
        ("largest_layer_params", largest_layer_params, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload_optimizer and stage == 0:
        raise ValueError(
            "offload_optimizer needs ZeRO stage 1, 2 or 3 (the host holds one rank's partition); "
            "got stage 0"
        )
    if offload_param and stage != 3:
        raise ValueError(
            f"offload_param needs ZeRO stage 3 (parameter partitioning), got stage {stage}"
        )


def estimate_all_stages(
    num_params: int,
    dp_size: int,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    **kwargs,
) -> list[MemoryEstimate]:
    """Estimates for stages 0-3; each offload option is applied only to the stages that support it
    (optimizer offload: 1-3; parameter offload: 3). ``kwargs`` go to :func:`estimate_model_state_memory`."""
    return [
        estimate_model_state_memory(
            num_params,
            dp_size,
            stage,
            offload_optimizer and stage >= 1,
            offload_param and stage == 3,
            **kwargs,
        )
        for stage in range(4)
    ]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(total parameters, parameters of the largest single module), counting tied parameters once.
    Works on meta-device models (no memory is touched)."""
    total = sum(p.numel() for p in model.parameters())
    largest = 0
    for module in model.modules():
        largest = max(largest, sum(p.numel() for p in module.parameters(recurse=False)))
    return total, largest


def estimate_for_model(model: nn.Module, dp_size: int, stage: int, **kwargs) -> MemoryEstimate:
    """:func:`estimate_model_state_memory` for ``model``'s parameters (tied ones once). At stage 3 the largest
    module's gathered weights and gradients are added unless ``largest_layer_params`` is given."""
    total, largest = count_parameters(model)
    kwargs.setdefault("largest_layer_params", largest if stage == 3 else 0)
    return estimate_model_state_memory(total, dp_size, stage, **kwargs)


def format_memory_table(estimates: Iterable[MemoryEstimate], unit: str = "GiB") -> str:
    """A plain-text table of estimates: per-GPU params/grads/optimizer/total and per-host total, in
    ``unit`` ("GiB" = 2**30 bytes or "GB" = 1e9 bytes)."""
    scale = {"GiB": GiB, "GB": GB}.get(unit)
    if scale is None:
        raise ValueError(f"unit must be 'GiB' or 'GB', got {unit!r}")
    head = ("stage", "offload", "GPU params", "GPU grads", "GPU optim", "GPU total", "host total")
    rows = [head]
    for e in estimates:
        rows.append(
            (
                str(e.stage),
                e.offload,
                *(
                    f"{b / scale:.2f}"
                    for b in (
                        e.gpu.params,
                        e.gpu.grads,
                        e.gpu.optimizer_states,
                        e.gpu.total,
                        e.cpu.total,
                    )
                ),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return (
        "\n".join(lines)
        + f"\n(model states only, in {unit}; GPU columns are per GPU, host per node)"
    )


def held_bytes(opt) -> dict[str, int]:
    """Bytes a ``ZeroOptimizer`` rank holds now, by kind (see ``ZeroOptimizer.memory_bytes``): ``params``,
    ``grads``, ``grad_shards``, ``master``, ``optimizer_state`` and ``total``."""
    seen, params = set(), 0
    for g in opt.groups:
        for seg in g.segments:
            for t in (seg.full, seg.local):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    params += t.untyped_storage().nbytes()
    out = {
        "params": params,
        "grads": sum(
            p.grad.numel() * p.grad.element_size() for p in opt.params if p.grad is not None
        ),
        "grad_shards": sum(
            g.untyped_storage().nbytes() for g in opt.grad_shards
        ),  # 0 between steps on the device
        "master": sum(m.numel() * m.element_size() for m in opt.masters),
        "optimizer_state": sum(
            v.numel() * v.element_size()
            for st in opt.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v)
        ),
    }
    out["total"] = sum(out.values())
    return out
