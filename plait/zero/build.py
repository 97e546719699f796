"""Construction steps of ``ZeroOptimizer``: param groups, the flat layout, fp32 masters, the torch optimizer.

ZeRO (Rajbhandari et al., SC'20, Sec. 5): every trainable parameter is packed into flat segments split
evenly over the dp ranks (``plait.zero.flat``); each rank keeps the fp32 master weights of its slices
(on the host with ZeRO-Offload, Ren et al., USENIX ATC'21) and an elementwise torch optimizer over them.

The torch optimizer sees one flat fp32 tensor per flat group, so it must treat parameters
elementwise (SGD, Adam, AdamW, Adagrad, RMSprop, Lion...). Optimizers that need per-tensor
norms see a flat shard that mixes and splits parameters: LAMB is told the tensors' pieces afterwards
(``plait.optim.lamb_segments``); LARS and Adafactor's factored moments are not supported.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.kernels.host_memory import keep_from_children
from plait.parallel.sharding import shard_of
from plait.zero.flat import Entry, FlatGroup, GroupKey
from plait.zero.offload.placement import placement_blocks, resident_params
from plait.zero.pinned import to_host
from plait.zero.policy import StagePolicy
from plait.zero.stage3_units import Unit, build_units


def check_experts(groups, stage: int, offload, comms) -> None:
    """ValueError for expert-parallel weights (``GroupKey.experts``) at stage 0 or with offload (not built yet:
    the stage-0 gradient norm and the offloaded steps cover the dp ranks only), or when ``comms.experts`` is not
    the group of the ``dp / ep`` ranks holding the same experts (``ParallelMesh.group("edp")``): over another
    group the reduction would add different experts' gradients (no group, or context parallelism, whose cp
    ranks hold the same experts on other tokens)."""
    experts = [
        slot.param for g in groups if g.key.experts for seg in g.segments for slot in seg.slots
    ]
    if not experts:
        return
    if offload is not None or stage == 0:
        raise ValueError(
            f"expert-parallel weights (ep > 1) need ZeRO stage 1, 2 or 3 without offload for now; "
            f"got stage {stage}, offload {offload is not None}"
        )
    ep, dp = shard_of(experts[0]).world, comms.dp.size
    if comms.experts.size * ep != dp:
        raise ValueError(
            f"expert weights split over ep={ep} ranks must be reduced over the {dp} // {ep} ranks "
            f"holding the same experts, but the expert group has {comms.experts.size} of the {dp} "
            "data-parallel ranks: pass expert_group=mesh.group('edp') (expert parallelism with "
            "context parallelism is not supported)"
        )


def check_arguments(
    policy: StagePolicy, gradient_accumulation_steps: int, offload, options: dict
) -> None:
    """``ZeroOptimizer``'s argument checks. ``options``: name -> (value, its option class); ``offload``: the
    ``OffloadOptions`` or None.

    Raises:
        ValueError: an option group of another type, offload at a stage that cannot hold it, GAS < 1 (the
            value and the fix named).
    """
    for name, (value, cls) in options.items():
        if value is not None and not isinstance(value, cls):
            raise ValueError(
                f"ZeroOptimizer({name}={value!r}) must be a {cls.__name__} or None; "
                f"pass {name}={cls.__name__}(...)"
            )
    if offload is not None and (
        offload.optimizer and not policy.optimizer_states or offload.param and not policy.parameters
    ):
        raise ValueError(
            f"offload_optimizer needs ZeRO stage 1-3 and offload_param stage 3, got stage {policy.stage} "
            f"with optimizer={offload.optimizer}, param={offload.param}; change the stage"
        )
    if gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}"
        )


def grad_dtypes(
    host: bool,
    gradient_accumulation_steps: int,
    groups: list[FlatGroup],
    world: int,
    reduce_dtype: torch.dtype,
) -> tuple[torch.dtype, torch.dtype]:
    """``(gradient shard dtype, dtype reduced gradients land in)``.

    ZeRO-Offload (``host``) with bf16 weights and no accumulation: the reduced gradient is bf16 already (one
    rank: backward's own bf16 gradient; dp > 1 (``world``): a bf16 reduction), so the host keeps it in bf16 --
    half the bytes over PCIe and in host memory, read as is by the CPU optimizer, and exact. Else fp32
    shards, landing in ``reduce_dtype``.
    """
    compact = (
        host
        and gradient_accumulation_steps == 1
        and all(g.key.dtype == torch.bfloat16 for g in groups)
        and (world == 1 or reduce_dtype == torch.bfloat16)
    )
    return (torch.bfloat16, torch.bfloat16) if compact else (torch.float32, reduce_dtype)


def weight_decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Torch-style param groups: ``weight_decay`` for matrices, 0 for biases and norm weights
    (parameters with fewer than 2 dims). Frozen parameters are left out."""
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def resolve_groups(named, param_groups) -> tuple[list[dict], dict[int, int]]:
    """``(per-group options without "params", {id(param): group index})`` for the trainable ``named``
    parameters. Raises ValueError: a tensor not in the module, a parameter twice or in no group."""
    if param_groups is None:
        return [{}], {id(p): 0 for _, p in named}
    names = {id(p): n for n, p in named}
    group_of: dict[int, int] = {}
    opts = []
    for i, g in enumerate(param_groups):
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in params:
            if not p.requires_grad:
                continue
            if id(p) not in names:
                raise ValueError(
                    f"param group {i} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "trainable parameter of the module; build groups from module.parameters()"
                )
            if id(p) in group_of:
                raise ValueError(
                    f"parameter {names[id(p)]} is in param groups {group_of[id(p)]} and {i}; "
                    "list each parameter once"
                )
            group_of[id(p)] = i
        opts.append({k: v for k, v in g.items() if k != "params"})
    missing = [n for n, p in named if id(p) not in group_of]
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameters are in no param group (first: {missing[:4]}); "
            "add them to a group or set requires_grad=False"
        )
    return opts, group_of


def layout_entries(
    module: nn.Module,
    named,
    group_of: dict[int, int],
    dtype,
    policy: StagePolicy,
    persistence_threshold: int,
    units,
    host_ratio: float = 1.0,
    cast=None,
) -> tuple[list[Entry], list[Unit]]:
    """Layout entries in packing order and the stage-3 units (empty below stage 3).

    ``host_ratio`` < 1 (offload, ``OffloadOptions.ratio``): the parameters ``placement.resident_params`` keeps
    on the device get flat groups of their own (``GroupKey.resident``).
    ``cast`` (stage 3, a ``plait.zero.gather_cast.GatherCast``): the sharded parameters it gathers cast get
    flat groups of their own (``GroupKey.cast``), so each segment is gathered whole in one dtype.

    Below stage 3: reverse registration order (~ the order backward produces gradients). Stage 3:
    parameters grouped by the unit that first holds them (the unit is part of their ``GroupKey``: one flat
    group per unit), then the persistent ones (fewer than ``persistence_threshold`` elements, whole on every
    rank) in reverse registration order.
    """
    resident: set[int] = set()

    def key(p, persistent=False, unit=None):
        spec = shard_of(p)
        experts = spec.axis == "ep" and spec.world > 1  # expert weights split over ep ranks
        return GroupKey(
            group_of[id(p)],
            dtype or p.dtype,
            not spec.tp_split,
            persistent,
            unit,
            experts,
            id(p) in resident,
            unit is not None and cast is not None and cast.casts(p),
        )

    if not policy.parameters:
        if host_ratio < 1:
            resident = resident_params(placement_blocks(named, []), host_ratio)
        return [Entry(n, p, key(p)) for n, p in reversed(named)], []
    persistent = {id(p) for _, p in named if p.numel() < persistence_threshold}
    built = build_units(module, {id(p) for _, p in named if id(p) not in persistent}, units)
    if host_ratio < 1:
        resident = resident_params(placement_blocks(named, built), host_ratio)
    owner = {}
    for u in built:
        for p in u.params:
            owner.setdefault(id(p), u.index)
    entries = sorted(
        (Entry(n, p, key(p, unit=owner[id(p)]), owner[id(p)]) for n, p in named if id(p) in owner),
        key=lambda e: e.unit,
    )
    entries += [Entry(n, p, key(p, True)) for n, p in reversed(named) if id(p) in persistent]
    return entries, built


def materialize(
    group: FlatGroup,
    policy: StagePolicy,
    device: torch.device,
    master_device: torch.device,
    host_params: bool,
    pin: bool,
    weights=None,
) -> nn.Parameter:
    """The fp32 master shard ``[shard_numel]`` of ``group`` on ``master_device``; its parameters are pointed
    at flat storage (compute dtype, on ``device``; stage-3 shards in ``seg.local``, on the host with
    ``host_params``). Values from the parameters, or from ``weights`` (a ``WeightSource``: only this
    rank's shard of stage-3 segments is read). The masters are filled in place, segment by segment: no second
    fp32 copy of the group is ever held."""
    sharded = policy.parameters and not group.key.persistent
    master = torch.empty(
        sum(seg.shard_size for seg in group.segments), dtype=torch.float32, device=master_device
    )
    at = 0
    for seg in group.segments:
        for slot in seg.slots:
            slot.param.grad = None
        if weights is not None and sharded:
            shard32 = read_shard(seg, weights, device)
            master[at : at + seg.shard_size].copy_(shard32)
            own = shard32.to(group.key.dtype)
        else:
            get = (
                (lambda s: s.param.detach())
                if weights is None
                else (lambda s: weights.read(s.name, 0, s.numel).to(device))
            )
            full32 = seg.pack(get, torch.float32, device=device)
            master[at : at + seg.shard_size].copy_(full32[seg.lo : seg.lo + seg.shard_size])
            full = (
                full32.to(group.key.dtype) if group.key.dtype != torch.float32 else full32.clone()
            )
            own = full[seg.lo : seg.lo + seg.shard_size]
        if sharded:
            seg.local = to_host(own, pin) if host_params else own.clone()
            seg.free()
        else:
            seg.set_views(full)
        at += seg.shard_size
    return keep_from_children(nn.Parameter(master))  # host masters: not copied into forked workers


def derive_shards(groups: list[FlatGroup], masters) -> None:
    """Stage 3 with each master beside its parameters (no offload): a sharded segment's compute-dtype shard is no longer
    kept but cast from its fp32 master slice right before each all-gather (``Segment.shard``), as FSDP2
    casts its sharded fp32 parameters: 2 bytes per parameter / dp less held, one cast per gather more."""
    for group, master in zip(groups, masters):
        for seg in group.segments:
            if seg.local is not None and seg.local.device == master.device:
                seg.source = master.detach()[seg.shard_offset : seg.shard_offset + seg.shard_size]
                seg.drop_shard()


def read_shard(seg, weights, device: torch.device) -> torch.Tensor:
    """This rank's ``[S]`` slice of ``seg`` in float32, read piece by piece from ``weights`` (zero padding)."""
    out = torch.zeros(seg.shard_size, dtype=torch.float32, device=device)
    for piece in seg.pieces():
        at = piece.shard_offset - seg.shard_offset
        out[at : at + piece.length] = weights.read(piece.slot.name, piece.start, piece.length).to(
            device
        )
    return out


def optimizer_groups(
    group_opts: list[dict], groups: list[FlatGroup], masters
) -> tuple[list[dict], list[int]]:
    """Torch param groups over the master shards (one per user group that has any) and, per flat group,
    the index of its master in the optimizer's flattened parameter order (checkpoints use it)."""
    opt_groups = []
    for gi, opts in enumerate(group_opts):
        members = [m for m, g in zip(masters, groups) if g.key.param_group == gi]
        if members:
            opt_groups.append({"params": members, **opts})
    order = {id(m): i for i, m in enumerate(m for g in opt_groups for m in g["params"])}
    return opt_groups, [order[id(m)] for m in masters]


def block_boundaries(groups: list[FlatGroup], masters) -> dict:
    """``{master: offsets}``: where each segment's shard and each parameter piece starts in its group's master
    shard, the starts of 8-bit moment blocks (``plait.kernels.quant``): a block never spans two segments
    (the stepper steps whole segments) nor two parameters (at one dp size every placement then cuts the
    same blocks, so the moments resume exactly in another placement)."""
    out = {}
    for group, master in zip(groups, masters):
        starts = {seg.shard_offset for seg in group.segments}
        starts |= {seg.shard_offset + seg.shard_size for seg in group.segments}
        starts |= {pc.shard_offset for pc in group.pieces()} | {
            pc.shard_offset + pc.length for pc in group.pieces()
        }
        out[master] = sorted(starts)
    return out


def unit_segments(units: list[Unit], groups: list[FlatGroup]) -> None:
    """Stage 3: fill each unit's ``segments`` (the sharded segments holding one of its parameters)."""
    for u in units:
        wanted = {id(p) for p in u.params}
        u.segments = [
            s
            for g in groups
            for s in g.segments
            if not s.key.persistent and any(id(sl.param) in wanted for sl in s.slots)
        ]
