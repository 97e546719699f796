"""What a training run of a model shape holds on one GPU and on its host, and whether it fits.

Model states follow plait's own accounting (``plait.zero.memory``, ``accounting="plait"``, from the ZeRO paper,
Rajbhandari et al., SC'20, Sec. 3.1) and, with ``offload_optimizer``, plait's GPU-first placement
(``plait.zero.offload.placement``); activations and loss come from ``plait.fit.activations``, the host's
process, runtime and model-build terms from ``plait.fit.host``. All sizes are bytes.

A run fits when the GPU peak plus :data:`CUDA_CONTEXT_BYTES` and :data:`ALLOCATOR_SLACK_BYTES` is at most the
GPU's memory and the host peak at most the host's. The per-element rows (GPU and host, with and without
offload, stage 3's gathered units): ``docs/fit.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from plait.fit.activations import activation_peak
from plait.fit.host import BUILD_BYTES_PER_PARAM, host_peak, host_terms
from plait.fit.shape import MAX_PARAMS, ModelShape
from plait.zero.memory import estimate_model_state_memory
from plait.zero.offload.placement import resident_params

GiB = 2**30
#: Device memory the CUDA driver holds outside torch's allocator (context, cuBLAS and attention kernels' code
#: and workspaces): 804,061,184 bytes measured on one H200 (torch 2.11.0+cu130; used minus reserved after three
#: Trainer-style steps of a 1.1B Llama; ``benchmarks/probe_memory_overheads.py``, ``results/estimate_memory.md``).
CUDA_CONTEXT_BYTES = 804_061_184
#: The caching allocator's reserve above the allocated peak (fragmentation): 2,139,895,296 bytes, max reserved
#: minus max allocated in the same measurement at micro-batch 4, sequence 2048.
ALLOCATOR_SLACK_BYTES = 2_139_895_296
#: Device bytes per element of the range one device step of Adam/AdamW holds besides the states it updates, by
#: moment dtype (``plait.zero.offload.device_states.state_update_`` and ``device_share.adam_update_``; freed
#: before the next forward). fp32: the float32 gradient copy, the square root and one quotient, 4 + 4 + 4. bf16:
#: the two moments widened to float32 besides, 8 + 12. int8: the two dequantized moments, and while one is
#: requantized (``plait.kernels.quant.quantize_``) its scaled values (4), ``bucketize``'s int64 codes (8) and
#: their uint8 cast (1): 8 + 13. Derivation: ``docs/fit.md``.
STEP_BYTES_PER_ELEMENT = {"fp32": 12, "bf16": 20, "int8": 21}
#: The host shares ``offload_optimizer.ratio: "auto"`` tries, smallest first (:func:`auto_ratio`).
RATIO_STEPS = tuple(i / 20 for i in range(21))


@dataclass(frozen=True)
class Settings:
    """A run on one GPU of ``gpu_bytes`` and a host of ``host_bytes`` (bytes); ``ratio``: the share of the
    optimizer states on the host with ``offload_optimizer`` (DeepSpeed's ``offload_optimizer.ratio``);
    ``device_share``: the default streamed device share of the host step is on (``device_step_fraction``
    None or "auto" with pin_memory); ``state_dtype``: Adam's moments in "fp32", "bf16" or "int8" (8-bit blocks of
    256 with a float32 scale each: ``plait.kernels.quant``; ``optimizer.params.state_dtype``); ``model_build``:
    "fp32" for a model built from its config on the host, "none" for one read by ``plait.hf.from_pretrained`` or
    built on the GPU (``plait.fit.host``); ``bucket_numel``: ``zero_optimization.reduce_bucket_size``, the most
    elements of a segment of parameters (one device step range, ``plait.zero.flat.build_layout``)."""

    gpu_bytes: int
    host_bytes: int
    micro_batch: int = 1
    seq_len: int = 2048
    checkpointing: bool = False
    stage: int = 3
    dp: int = 1
    offload_optimizer: bool = False
    offload_param: bool = False
    ratio: float = 1.0
    gradient_accumulation: int = 1
    device_share: bool = True
    state_dtype: str = "fp32"
    model_build: str = "none"
    bucket_numel: int = 500_000_000

    def __post_init__(self):
        for key in (
            "gpu_bytes",
            "host_bytes",
            "micro_batch",
            "seq_len",
            "dp",
            "gradient_accumulation",
            "bucket_numel",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be a whole number >= 1")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage={self.stage!r} must be 0, 1, 2 or 3")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"offload_optimizer.ratio={self.ratio!r} must be in [0, 1]")
        if self.state_dtype not in ("fp32", "bf16", "int8"):
            raise ValueError(f"state_dtype={self.state_dtype!r} must be 'fp32', 'bf16' or 'int8'")
        if self.model_build not in BUILD_BYTES_PER_PARAM:
            raise ValueError(
                f"model_build={self.model_build!r} must be one of {sorted(BUILD_BYTES_PER_PARAM)}"
            )


def moment_bytes(elements: int, state_dtype: str) -> int:
    """Bytes of Adam's two moments over ``elements``: 4 + 4, 2 + 2, or 1 + 1 plus a float32 scale per block of 256
    for each (``plait.kernels.quant``)."""
    if state_dtype == "int8":
        return 2 * elements + 8 * math.ceil(elements / 256)
    return (8 if state_dtype == "fp32" else 4) * elements


@dataclass(frozen=True)
class Plan:
    """Bytes of one run: ``rows`` (state, GPU bytes, host bytes), ``host_terms`` (the host's other terms,
    ``plait.fit.host``), ``step`` (the device step's working bytes, :func:`step_bytes`), the peaks, and whether it
    fits."""

    shape: ModelShape
    settings: Settings
    rows: tuple[tuple[str, int, int], ...]
    activations: int
    gpu_peak: int
    host_peak: int
    host_terms: tuple[tuple[str, int], ...] = ()
    step: int = 0

    @property
    def host_states(self) -> int:
        """The planned host states: the rows' host bytes."""
        return sum(r[2] for r in self.rows)

    @property
    def gpu_need(self) -> int:
        """The GPU peak plus the CUDA context and the allocator's reserve."""
        return self.gpu_peak + CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK_BYTES

    @property
    def fits(self) -> bool:
        return (
            self.gpu_need <= self.settings.gpu_bytes and self.host_peak <= self.settings.host_bytes
        )


def unit_params(shape: ModelShape, stage: int) -> list[list[int]]:
    """The units of placement in forward order, each as its parameters' elements in registration order:
    ZeRO-3's units (embedding, each block, final norm, head: ``plait.engine.model.stage3_units``), below stage 3
    each parameter a unit of its own."""
    h, q, kv, f = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.ffn_hidden_size,
    )
    block = [h * q, h * kv, h * kv, q * h, h * f, h * f, f * h, h, h]
    head = [] if shape.tied_embeddings else [[shape.vocab_size * h]]
    units = [[shape.embedding_params]] + [block] * shape.num_layers + [[h]] + head
    return units if stage == 3 else [[n] for unit in units for n in unit]


def unit_sizes(shape: ModelShape, stage: int) -> list[int]:
    """Elements of the units of placement in forward order (:func:`unit_params`)."""
    return [sum(unit) for unit in unit_params(shape, stage)]


def resident_elements(shape: ModelShape, stage: int, ratio: float) -> int:
    """Elements whose optimizer states stay on the GPU at host share ``ratio``: ``placement.resident_params``
    over meta tensors of the units' sizes (nothing is allocated)."""
    if ratio >= 1.0:
        return 0
    blocks = [[torch.empty(n, device="meta")] for n in unit_sizes(shape, stage)]
    chosen = resident_params(blocks, ratio)
    return sum(b[0].numel() for b in blocks if id(b[0]) in chosen)


def largest_resident_segment(shape: ModelShape, s: Settings) -> int:
    """Elements of this rank's largest segment whose states stay on the GPU at host share ``s.ratio``: the
    resident parameters (``placement.resident_params`` over meta tensors) packed as ``flat.build_layout`` packs
    them (a segment closes past ``s.bucket_numel`` elements, and at a unit's end at stage 3), split over dp."""
    if s.ratio >= 1.0:
        return 0
    blocks = [[torch.empty(n, device="meta") for n in unit] for unit in unit_params(shape, s.stage)]
    chosen = resident_params(blocks, s.ratio)
    largest = open_segment = 0
    for block in blocks:
        if s.stage == 3:
            open_segment = 0
        for n in (t.numel() for t in block if id(t) in chosen):
            if open_segment and open_segment + n > s.bucket_numel:
                open_segment = 0
            open_segment += n
            largest = max(largest, open_segment)
    return math.ceil(largest / s.dp)


def step_bytes(shape: ModelShape, s: Settings) -> int:
    """Device bytes the optimizer step holds besides the states, at its peak (after backward: the activations
    are freed): :data:`STEP_BYTES_PER_ELEMENT` times the largest range stepped at once on the device. With
    ``offload_optimizer``, the resident share is stepped one segment at a time (``DeviceShare._step_resident``);
    without it, bf16/int8 moments are stepped one master at a time (``HostOptimizer.step``: one per ZeRO-3 unit,
    below stage 3 the rank's partition) and fp32 ones by torch's fused AdamW (not counted)."""
    if s.offload_optimizer:
        elements = 0 if s.offload_param else largest_resident_segment(shape, s)
    elif s.state_dtype == "fp32":
        elements = 0
    else:
        whole = max(unit_sizes(shape, 3)) if s.stage == 3 else shape.params
        elements = math.ceil(whole / (s.dp if s.stage else 1))
    return STEP_BYTES_PER_ELEMENT[s.state_dtype] * elements


def auto_ratio(shape: ModelShape, s: Settings) -> tuple[float, str]:
    """``offload_optimizer.ratio: "auto"``: the smallest host share of :data:`RATIO_STEPS` whose planned GPU need
    fits ``s.gpu_bytes`` (1, every state on the host, when none does), and the reason, said by the engine's log
    (``plait.fit.check``) and ``plait estimate-memory --ratio auto``."""
    if s.offload_param:
        return 1.0, "offload_param keeps every optimizer state on the host"
    found = first_ratio(shape, s, lambda plan: plan.gpu_need <= s.gpu_bytes)
    if found is None:
        return 1.0, f"even every state on the host does not fit {s.gpu_bytes / GiB:.1f} GiB"
    ratio, plan = found
    return ratio, (
        f"planned GPU need {plan.gpu_need / GiB:.1f} of {s.gpu_bytes / GiB:.1f} GiB at "
        f"micro-batch {s.micro_batch} x {s.seq_len} tokens"
    )


def first_ratio(shape: ModelShape, s: Settings, accept, above: float = -1.0):
    """The smallest host share of :data:`RATIO_STEPS` over ``above`` whose plan (``offload_optimizer`` on)
    ``accept`` takes, with that plan; None when none does."""
    for ratio in (r for r in RATIO_STEPS if r > above):
        plan = estimate(shape, replace(s, offload_optimizer=True, ratio=ratio))
        if accept(plan):
            return ratio, plan
    return None


def _offload_rows(shape: ModelShape, s: Settings, part: int) -> list[tuple[str, int, int]]:
    res = resident_elements(shape, s.stage, s.ratio) * part // shape.params
    host = part - res
    g = 2 if s.gradient_accumulation == 1 else 4
    weights = part if s.stage == 3 else shape.params
    rows = [
        (
            "weights (bf16)",
            0 if s.offload_param else 2 * weights,
            2 * weights if s.offload_param else 0,
        )
    ]
    if s.stage == 1:
        rows.append(("gradients (bf16, before the step)", 2 * shape.params, 0))
    rows += [
        (f"gradient shard ({'bf16' if g == 2 else 'fp32'})", g * res, g * host),
        ("fp32 master weights", 4 * res, 4 * host),
        (
            f"Adam moments ({s.state_dtype})",
            moment_bytes(res, s.state_dtype),
            moment_bytes(host, s.state_dtype),
        ),
    ]
    if not s.offload_param:
        rows.append(("bf16 copy-out buffer", 0, 2 * host))
    # bf16/int8 moments are never streamed (``HostStepper._streams_moments``): they step on the host or resident
    if (
        s.device_share
        and s.gradient_accumulation == 1
        and not s.offload_param
        and host
        and s.state_dtype == "fp32"
    ):
        rows.append(("device share: streamed gradients (at most)", g * host, 0))
    return rows


def unplanned(s: Settings) -> str | None:
    """Why the planner does not model settings ``s`` (None: it does)."""
    if s.offload_optimizer and (s.stage == 0 or (s.offload_param and s.stage != 3)):
        return (
            f"offload_optimizer needs ZeRO stage 1-3 and offload_param stage 3; got stage {s.stage}"
        )
    if s.offload_optimizer and s.offload_param and s.ratio < 1:
        return (
            f"offload_optimizer.ratio={s.ratio} keeps optimizer states on the GPU, which "
            "offload_param does not allow in plait; set the ratio to 1 or drop offload_param"
        )
    if s.offload_param and not s.offload_optimizer:
        return "the plan models offload_param with offload_optimizer only (set both, or neither)"
    return None


def estimate(shape: ModelShape, s: Settings) -> Plan:
    """The :class:`Plan` of training ``shape`` with settings ``s`` (module docstring).

    Raises:
        ValueError: settings the plan does not model (``unplanned``).
    """
    part = math.ceil(shape.params / s.dp)
    why = unplanned(s)
    if why:
        raise ValueError(why)
    if s.offload_optimizer:
        rows = _offload_rows(shape, s, part)
    else:
        e = estimate_model_state_memory(shape.params, s.dp, s.stage, accounting="plait")
        held = e.gpu.optimizer_states // 12  # elements whose master and moments this rank holds
        rows = [
            ("weights (bf16)", e.gpu.params, 0),
            ("gradients", e.gpu.grads, 0),
            ("fp32 master weights", 4 * held, 0),
            (f"Adam moments ({s.state_dtype})", moment_bytes(held, s.state_dtype), 0),
        ]
    units = sorted(unit_sizes(shape, 3))[-2:]
    if s.stage == 3 and (s.dp > 1 or s.offload_param or not s.offload_optimizer):
        rows.append(("stage 3: gathered units (bf16)", 2 * sum(units), 0))
    acts = activation_peak(shape, s.micro_batch * s.seq_len, s.checkpointing)
    # the step follows backward: its working bytes (and ZeRO-3's fp32 gradient shard, alive from backward to the
    # step) are held after the activations are freed; the peak counts the larger of the two
    late = rows[1][1] if s.stage == 3 and not s.offload_optimizer else 0
    step = step_bytes(shape, s)
    gpu = sum(r[1] for r in rows) - late + max(acts, late + step)
    terms = host_terms(shape.params, s.offload_optimizer, s.model_build)
    return Plan(
        shape, s, tuple(rows), acts, gpu, host_peak(terms, sum(r[2] for r in rows)), terms, step
    )


def largest_fitting(shape: ModelShape, s: Settings) -> ModelShape | None:
    """The deepest model of ``shape``'s widths (more or fewer layers) that fits with ``s``; None when not even
    one layer fits. Binary search over the layer count (the peaks grow with it)."""
    if not estimate(shape.with_layers(1), s).fits:
        return None
    low, high = 1, 2
    while (
        estimate(shape.with_layers(high), s).fits and shape.with_layers(high).params <= MAX_PARAMS
    ):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if estimate(shape.with_layers(mid), s).fits else (low, mid)
    return shape.with_layers(low)


def fixes(shape: ModelShape, s: Settings) -> list[str]:
    """Single changes of ``s`` under which ``shape`` fits, as config/flag texts (empty when none does)."""
    out = []
    if s.stage >= 1 and not s.offload_param:
        above = s.ratio if s.offload_optimizer else -1.0
        found = first_ratio(shape, s, lambda plan: plan.fits, above)
        if found is not None:
            out.append(
                f"zero_optimization.offload_optimizer with ratio {found[0]:g} (the share of optimizer "
                "states on the host)"
            )
    if not s.checkpointing and estimate(shape, replace(s, checkpointing=True)).fits:
        out.append("activation checkpointing on (the Trainer's gradient_checkpointing=True)")
    for micro in range(s.micro_batch - 1, 0, -1):
        if estimate(shape, replace(s, micro_batch=micro)).fits:
            out.append(f"micro-batch {micro} (train_micro_batch_size_per_gpu)")
            break
    if s.stage == 3 and s.offload_optimizer and not s.offload_param:
        if estimate(shape, replace(s, offload_param=True, ratio=1.0)).fits:
            out.append(
                "zero_optimization.offload_param (weights on the host too; offload_optimizer.ratio 1)"
            )
    if s.stage < 3 and estimate(shape, replace(s, stage=3)).fits:
        out.append("ZeRO stage 3 (zero_optimization.stage)")
    return out
