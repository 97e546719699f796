"""Checks of a micro-batch at the engine's edge, before any rank computes with it.

Token ids and labels outside the vocabulary and sequences longer than the model's positions are caught here,
against ``BatchLimits`` read from the model's config; token ids, labels and positions of any integer dtype
are cast to int64 once. With autograd on, a micro-batch is screened (``screen_micro_batch``): the model
computes on a stand-in (identical for valid input) and the verdict is agreed over every rank at the
accumulation boundary (``plait.engine.guard``), so one rank's bad micro-batch drops the step on every rank.
A batch that cannot be computed at all (not a dict, ids that are not integers, an empty tensor) raises at
once. Why each check, and how a batch on a GPU is checked without a host sync: ``docs/engine.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from plait.data.masking import IGNORE_INDEX
from plait.engine.context import SEQUENCE_KEYS

_UNBOUNDED = 2**62


@dataclass(frozen=True)
class BatchLimits:
    """What a micro-batch must fit; None: not checked.

    Attributes:
        vocab_size: V: ``input_ids`` and ``labels`` (except -100) in ``[0, V)``.
        max_positions: P: sequences of at most P tokens, or ``position_ids`` in ``[0, P)`` when given.
    """

    vocab_size: int | None = None
    max_positions: int | None = None


def batch_limits(model_config) -> BatchLimits:
    """``BatchLimits`` of a model from its config (plait's ``TransformerConfig`` or a Hugging Face config;
    None: no limits): ``vocab_size`` and ``max_position_embeddings`` (GPT-2's ``n_positions``), the latter
    not where the config says how RoPE positions extrapolate (a ``rope_scaling``/``rope_parameters`` type
    other than "default")."""
    vocab = getattr(model_config, "vocab_size", None)
    positions = getattr(model_config, "max_position_embeddings", None)
    scaling = getattr(model_config, "rope_scaling", None) or getattr(
        model_config, "rope_parameters", None
    )
    rope_type = (
        scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else None
    )
    if rope_type not in (None, "default"):
        positions = None
    return BatchLimits(_positive_int(vocab), _positive_int(positions))


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class _Ids(NamedTuple):
    name: str
    ids: torch.Tensor
    ignore: int | None  # a value allowed outside the range (labels: -100)
    bound: int  # values must be in [0, bound)


def _entries(batch, limits: BatchLimits) -> list[_Ids]:
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"a micro-batch is a dict of model inputs (input_ids [b, s], labels [b, s], ...), got "
            f"{type(batch).__name__}"
        )
    vocab = limits.vocab_size or _UNBOUNDED
    spec = [("input_ids", None, vocab), ("labels", IGNORE_INDEX, vocab)]
    if limits.max_positions is not None:
        spec.append(("position_ids", None, limits.max_positions))
    return [
        _Ids(key, batch[key], ignore, bound)
        for key, ignore, bound in spec
        if batch.get(key) is not None
    ]


def check_micro_batch(batch, limits: BatchLimits) -> dict:
    """Check one micro-batch dict now (one host synchronization when it is on a device) and return it with
    ``input_ids``, ``labels`` and ``position_ids`` as int64 (other entries as given).

    Args:
        batch: the micro-batch (``input_ids [b, s]``, ``labels [b, s]``, other model inputs).
        limits: the model's ``BatchLimits`` (``batch_limits``).

    Raises:
        TypeError: a batch that is not a dict, or ids that are not an integer tensor (naming the dtype).
        ValueError: an empty tensor, an id outside the range (naming the id, its position ``name[row, column]``
            and V), or a sequence longer than ``max_position_embeddings`` (naming both numbers).
    """
    todo = _entries(batch, limits)
    _check_types(todo)
    problem = _too_long(batch, todo, limits) or (
        _out_of_range(todo, _bounds(todo).tolist()) if todo else None
    )
    if problem is not None:
        raise ValueError(problem)
    return _as_long(batch, todo)


def _check_types(todo: list[_Ids]) -> None:
    for name, ids, _, _ in todo:
        if (
            not torch.is_tensor(ids)
            or ids.dtype.is_floating_point
            or ids.is_complex()
            or ids.dtype == torch.bool
        ):
            got = ids.dtype if torch.is_tensor(ids) else type(ids).__name__
            what = "positions" if name == "position_ids" else "token ids"
            raise TypeError(
                f"{name} must be an integer tensor of {what} (torch.long), got {got}; "
                f"tokenize to integers, or .long() a float tensor that holds whole numbers"
            )
        if ids.numel() == 0:
            raise ValueError(
                f"{name} is empty (shape {list(ids.shape)}): a micro-batch needs at least one token"
            )


def _as_long(batch, todo: list[_Ids]) -> dict:
    return {**batch, **{e.name: e.ids.long() for e in todo}}


def _valid(ids: torch.Tensor, ignore: int | None) -> torch.Tensor:
    return ids if ignore is None else ids.masked_fill(ids == ignore, 0)


def _bounds(todo: list[_Ids]) -> torch.Tensor:
    """``[min, max]`` of every tensor (ignored labels counted as 0), stacked: ``[2 * len(todo)]`` int64."""
    device = todo[0].ids.device
    return torch.stack(
        [v.long() for e in todo for v in torch.aminmax(_valid(e.ids, e.ignore).to(device))]
    )


def _seq_len(batch) -> tuple[str, torch.Tensor] | None:
    for key in ("input_ids", "labels"):
        if torch.is_tensor(batch.get(key)):
            return key, batch[key]
    return None


def _too_long(batch, todo: list[_Ids], limits: BatchLimits) -> str | None:
    """The problem of sequences longer than ``max_positions`` when no ``position_ids`` are given (shapes only)."""
    limit, seq = limits.max_positions, _seq_len(batch)
    if (
        limit is None
        or seq is None
        or batch.get("position_ids") is not None
        or seq[1].shape[-1] <= limit
    ):
        return None
    name, ids = seq
    return (
        f"{name} holds sequences of {ids.shape[-1]} tokens (shape {list(ids.shape)}) but the model's "
        f"max_position_embeddings is {limit}: cut the sequences to at most {limit} tokens (the tokenizer's "
        f"max_length, the data's block size), or give the model a config that takes longer ones (a larger "
        f"max_position_embeddings, or rope_scaling for a Hugging Face RoPE model)"
    )


def _out_of_range(todo: list[_Ids], bounds: list) -> str | None:
    """The first entry outside its range, as a message naming the value, its position and the range."""
    for (name, ids, ignore, bound), lo, hi in zip(todo, bounds[::2], bounds[1::2]):
        if lo < 0 or hi >= bound:
            t = _valid(ids, ignore)
            where = ((t < 0) | (t >= bound)).nonzero()[0].tolist()
            value = int(ids[tuple(where)])
            at = f"{name}[{', '.join(map(str, where))}] = {value}"
            if name == "position_ids":
                return (
                    f"{at} is outside the model's positions: position ids must be in [0, {bound}) "
                    f"(max_position_embeddings {bound}); cut the sequences or fix the position ids"
                )
            allowed = f"[0, {bound})" + (f" or {ignore} (ignored)" if ignore is not None else "")
            return (
                f"{at} is outside the model's vocabulary: token ids must be in {allowed}. Check that the "
                f"tokenizer's vocabulary fits the model's vocab_size ({bound}) and that padding uses a valid id"
            )
    return None


class Verdict:
    """The verdict on a micro-batch checked at once: ``problem()`` is the message, or None for a good one."""

    def __init__(self, message: str | None):
        self.message = message

    def problem(self) -> str | None:
        return self.message


class PendingCheck:
    """The verdict on a screened device micro-batch, read later (``problem``) without a sync now."""

    def __init__(self, todo: list[_Ids], known: str | None):
        self.todo, self.known = todo, known
        device_bounds = _bounds(todo)
        self.bounds = torch.empty(device_bounds.shape, dtype=device_bounds.dtype, pin_memory=True)
        self.bounds.copy_(device_bounds, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def problem(self) -> str | None:
        """Wait for the bounds (long computed by now); the message ``check_micro_batch`` raises, or None."""
        self.ready.synchronize()
        return self.known or _out_of_range(self.todo, self.bounds.tolist())


def screen_micro_batch(batch, limits: BatchLimits) -> tuple[dict, Verdict | PendingCheck | None]:
    """``check_micro_batch`` for the engine's forward: ``(batch to compute with, verdict or None)``.

    With autograd off (evaluation) the batch is checked now and returned (ids as int64). With it on, types
    and emptiness are checked now and the verdict (``.problem()``: the message or None) is read at the
    accumulation boundary: on the host it is known now (None is returned for a good batch), on a CUDA
    device it is a ``PendingCheck``. Until then the model computes on ``_stand_in``: the same tensors'
    values for a valid batch.

    Raises:
        TypeError / ValueError: a batch that cannot be computed (as ``check_micro_batch``); in evaluation
            every problem.
    """
    todo = _entries(batch, limits)
    _check_types(todo)
    if not torch.is_grad_enabled() or not todo:
        return check_micro_batch(batch, limits), None
    too_long = _too_long(batch, todo, limits)
    if all(e.ids.is_cuda for e in todo):
        return _stand_in(batch, todo, limits, cut=too_long is not None), PendingCheck(
            todo, too_long
        )
    problem = too_long or _out_of_range(todo, _bounds(todo).tolist())
    if problem is None:
        return _as_long(batch, todo), None
    return _stand_in(batch, todo, limits, cut=too_long is not None), Verdict(problem)


def _stand_in(batch, todo: list[_Ids], limits: BatchLimits, cut: bool) -> dict:
    """The batch to compute with while its verdict is pending: each checked entry as int64 clamped into its
    range (ignored labels kept); with ``cut``, every ``[b, s, ...]`` sequence entry cut to ``[b, P, ...]``."""
    safe = dict(batch)
    for name, ids, ignore, bound in todo:
        ids = ids.long()
        clamped = ids.clamp(0, bound - 1)
        safe[name] = clamped if ignore is None else torch.where(ids == ignore, ids, clamped)
    if cut:
        limit = limits.max_positions
        safe = {
            k: v[:, :limit] if k in SEQUENCE_KEYS and torch.is_tensor(v) and v.dim() >= 2 else v
            for k, v in safe.items()
        }
    return safe


def to_half(inputs):
    """``inputs`` with every floating-point tensor cast to fp16, through tuples, lists and dicts (DeepSpeed's
    ``fp16.auto_cast`` of a forward's inputs); integer tensors (token ids, masks) and other values as given."""
    if torch.is_tensor(inputs):
        return inputs.half() if inputs.is_floating_point() else inputs
    if isinstance(inputs, Mapping):
        return {k: to_half(v) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(to_half(v) for v in inputs)
    return inputs
