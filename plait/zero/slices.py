"""The logical view of a rank's ZeRO shards, what a checkpoint stores: ``ParamSlice`` (a run of one
parameter's flattened elements with its fp32 master and optimizer state), ``ShardState`` (a rank's slices,
per-group scalars and counters), ``shard_state`` / ``load_shard_state`` (a ``ZeroOptimizer``'s, at any dp
size and stage), and ``slices_reader`` (a ``read`` over saved slices). Layout: ``plait.zero.flat``.
"""

from __future__ import annotations

from collections.abc import Callable
import logging
from dataclasses import dataclass

import torch


@dataclass
class ParamSlice:
    """Flattened elements ``[start, start+length)`` of parameter ``name`` held by one rank.

    ``shape`` is the parameter's shape as this process holds it (its tp-local shard; map to the
    logical tensor with its ``plait_shard``). ``master`` is float32 ``[length]``; ``state`` maps each
    elementwise optimizer state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) to ``[length]``.
    From ``ZeroOptimizer.shard_state()`` these are views of live buffers: copy before training on.
    """

    name: str
    shape: tuple[int, ...]
    start: int
    length: int
    master: torch.Tensor
    state: dict[str, torch.Tensor]


@dataclass
class ShardState:
    """Everything a checkpoint needs from one rank's ZeroOptimizer.

    ``groups`` maps each param-group index (as passed to the optimizer) to ``{"hyper": {lr, ...},
    "scalars": {"step": 5.0, ...}, "elementwise": ["exp_avg", ...], "state_dtype": "fp32"}``: the elementwise
    states are float32 values whatever ``state_dtype`` (fp32, bf16, int8: ``plait.kernels.quant``) the run
    stored them in, so a resume in another state dtype converts them by name. With ``replicated`` (stage 0)
    every dp rank holds identical whole slices: write them from dp rank 0 only; otherwise the dp
    ranks' slices are disjoint and together cover every parameter.
    """

    slices: list[ParamSlice]
    groups: dict[int, dict]
    loss_scaler: dict | None
    global_steps: int
    skipped_steps: int
    stage: int
    dp_size: int
    dp_rank: int

    @property
    def replicated(self) -> bool:
        return self.stage == 0


def shard_state(opt) -> ShardState:
    """``opt.shard_state()``: build a ``ShardState`` of a ``ZeroOptimizer`` (views, no copies)."""
    slices, groups = [], {}
    export = getattr(
        opt.optimizer, "checkpoint_state", None
    )  # moments stored in bf16/int8: as float32
    state_dtype = getattr(opt.optimizer, "state_dtype", "fp32")
    for group, master in zip(opt.groups, opt.masters):
        st = export(master) if export is not None else opt.optimizer.state.get(master, {})
        elem = {k: v for k, v in st.items() if torch.is_tensor(v) and v.shape == master.shape}
        info = groups.setdefault(
            group.key.param_group,
            {"hyper": {}, "scalars": {}, "elementwise": sorted(elem), "state_dtype": state_dtype},
        )
        info["scalars"].update({k: float(v) for k, v in st.items() if k not in elem})
        for piece in group.pieces():
            sl = slice(piece.shard_offset, piece.shard_offset + piece.length)
            slices.append(
                ParamSlice(
                    piece.slot.name,
                    tuple(piece.slot.shape),
                    piece.start,
                    piece.length,
                    master.detach()[sl],
                    {k: v[sl] for k, v in elem.items()},
                )
            )
    for pg in opt.optimizer.param_groups:
        index = next(
            g.key.param_group for g, m in zip(opt.groups, opt.masters) if m is pg["params"][0]
        )
        groups[index]["hyper"] = {k: v for k, v in pg.items() if k != "params"}
    scaler = opt.scaler.state_dict() if opt.scaler is not None else None
    return ShardState(
        slices,
        groups,
        scaler,
        opt.global_steps,
        opt.skipped_steps,
        opt.stage,
        opt.dp_size,
        opt.dp_rank,
    )


def load_shard_state(
    opt, read: Callable[[str, str, int, int], torch.Tensor], state: ShardState | None
) -> None:
    """Fill ``opt``'s master and optimizer-state shards from a checkpoint saved at any dp size/stage.

    Args:
        read: ``read(name, kind, start, length)`` returns flattened elements ``[start, start+length)``
            of parameter ``name``'s ``kind`` ("master" or an elementwise state key) — e.g. a lazy
            safetensors slice, or ``slices_reader(saved_slices)``.
        state: the saved ``ShardState`` for hyperparameters, scalar state (``step``), loss scaler and
            counters (its ``slices`` are not used); None restores only the master weights.

    Collective (parameters are all-gathered afterwards). Raises KeyError / ValueError from ``read``
    for missing parameters or ranges.
    """
    per_index: dict[int, dict] = {}
    converted = set()
    for group, master, index in zip(opt.groups, opt.masters, opt._opt_index):
        info = state.groups.get(group.key.param_group, {}) if state is not None else {}
        keys = info.get("elementwise", [])
        if keys and info.get("state_dtype", "fp32") != getattr(
            opt.optimizer, "state_dtype", "fp32"
        ):
            converted.add(info.get("state_dtype", "fp32"))
        new_master = torch.zeros_like(master, requires_grad=False)
        bufs = {k: torch.zeros_like(new_master) for k in keys}
        for piece in group.pieces():
            sl = slice(piece.shard_offset, piece.shard_offset + piece.length)
            name = piece.slot.name
            new_master[sl] = read(name, "master", piece.start, piece.length)
            for k in keys:
                bufs[k][sl] = read(name, k, piece.start, piece.length)
        master.data.copy_(new_master)
        if keys or info.get("scalars"):
            scalars = {
                k: torch.tensor(v, dtype=torch.float32) for k, v in info.get("scalars", {}).items()
            }
            per_index[index] = {**scalars, **bufs}
    if state is not None:
        current = opt.optimizer.state_dict()
        for pg, live in zip(current["param_groups"], opt.optimizer.param_groups):
            index = next(
                g.key.param_group for g, m in zip(opt.groups, opt.masters) if m is live["params"][0]
            )
            pg.update(state.groups.get(index, {}).get("hyper", {}))
        opt.optimizer.load_state_dict({"state": per_index, "param_groups": current["param_groups"]})
        if opt.scaler is not None and state.loss_scaler is not None:
            opt.scaler.load_state_dict(state.loss_scaler)
        opt.global_steps, opt.skipped_steps = state.global_steps, state.skipped_steps
    if converted and opt.dp_rank == 0:
        logging.getLogger("plait").warning(
            "optimizer states saved as %s are loaded by name into state_dtype %s (values as saved, stored in the "
            "new precision)",
            "/".join(sorted(converted)),
            getattr(opt.optimizer, "state_dtype", "fp32"),
        )
    opt.write_back()


def slices_reader(slices) -> Callable[[str, str, int, int], torch.Tensor]:
    """A ``read`` function for ``load_shard_state`` over saved ``ParamSlice`` s (e.g. every old rank's).

    Raises (from ``read``):
        KeyError: no slice of that parameter, or a state kind that was not saved.
        ValueError: the saved slices do not cover the requested range (names the gap).
    """
    index: dict[str, list[ParamSlice]] = {}
    for s in slices:
        index.setdefault(s.name, []).append(s)

    def read(name: str, kind: str, start: int, length: int) -> torch.Tensor:
        if name not in index:
            raise KeyError(
                f"no saved slices for parameter {name!r} (saved: {len(index)} parameters)"
            )
        out = torch.zeros(length, dtype=torch.float32)
        covered = torch.zeros(length, dtype=torch.bool)
        for s in index[name]:
            a, b = max(start, s.start), min(start + length, s.start + s.length)
            if a >= b:
                continue
            src = s.master if kind == "master" else s.state[kind]
            out[a - start : b - start] = src[a - s.start : b - s.start]
            covered[a - start : b - start] = True
        if not bool(covered.all()):
            gap = int((~covered).nonzero()[0]) + start
            raise ValueError(
                f"saved slices of {name!r} do not cover element {gap} of the requested "
                f"[{start}, {start + length}); the checkpoint is missing a rank's shard"
            )
        return out

    return read
