"""Checks of a micro-batch at the engine's edge, before any rank computes with it.

A token id outside the vocabulary does not fail where it is used: the vocabulary-parallel embedding and
cross entropy (tp > 1) mask it and train on silently, torch's embedding at tp = 1 raises a bare
``IndexError`` on the CPU and a device-side assert on CUDA, and a label past the vocabulary gives an
``inf`` loss. So the engine checks every micro-batch here first. A batch on the host is checked at once
(one min/max per tensor, no device work). A batch already on a GPU is screened without a host
synchronization (``screen_micro_batch``): the min/max go to pinned host memory behind an event, the
model computes on a copy with every id clamped into range (identical for valid input), and the engine
reads the result at the accumulation boundary, before the optimizer step, raising there for a bad
micro-batch after dropping the accumulated gradients (benchmarks/bench_input_checks.py measures both).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from plait.data.masking import IGNORE_INDEX


def check_micro_batch(batch, vocab_size: int | None) -> None:
    """Check one micro-batch dict: ``input_ids`` in ``[0, V)``, ``labels`` in ``[0, V)`` or -100, with one
    host synchronization for both when they are on a device.

    Args:
        batch: the micro-batch (``input_ids [b, s]``, ``labels [b, s]``, other model inputs).
        vocab_size: V, or None when the model does not state it (then only the types are checked).

    Raises:
        TypeError: a batch that is not a dict, or ids that are not an integer tensor (naming the dtype).
        ValueError: an empty tensor, or an id outside the range, naming the id, its position
            (``name[row, column]``) and V.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"a micro-batch is a dict of model inputs (input_ids [b, s], labels [b, s], ...), got "
                        f"{type(batch).__name__}")
    todo = [(key, batch[key], ignore) for key, ignore in (("input_ids", None), ("labels", IGNORE_INDEX))
            if batch.get(key) is not None]
    _check_all(todo, vocab_size if vocab_size is not None else 2 ** 62)


def _check_all(todo: list, vocab_size: int) -> None:
    _check_types(todo)
    if todo:
        _raise_if_out_of_range(todo, _bounds(todo).tolist(), vocab_size)


def _check_types(todo: list) -> None:
    for name, ids, _ in todo:
        if not torch.is_tensor(ids) or ids.dtype.is_floating_point or ids.is_complex() or ids.dtype == torch.bool:
            got = ids.dtype if torch.is_tensor(ids) else type(ids).__name__
            raise TypeError(f"{name} must be an integer tensor of token ids (torch.long), got {got}; "
                            f"tokenize to integers, or .long() a float tensor that holds whole numbers")
        if ids.numel() == 0:
            raise ValueError(f"{name} is empty (shape {list(ids.shape)}): a micro-batch needs at least one token")


def _valid(ids: torch.Tensor, ignore: int | None) -> torch.Tensor:
    return ids if ignore is None else ids.masked_fill(ids == ignore, 0)


def _bounds(todo: list) -> torch.Tensor:
    """``[min, max]`` of every tensor (ignored labels counted as 0), stacked: ``[2 * len(todo)]`` int64."""
    device = todo[0][1].device
    return torch.stack([v for _, ids, ignore in todo for v in torch.aminmax(_valid(ids, ignore).to(device))])


def _raise_if_out_of_range(todo: list, bounds: list, vocab_size: int) -> None:
    for (name, ids, ignore), lo, hi in zip(todo, bounds[::2], bounds[1::2]):
        if lo < 0 or hi >= vocab_size:
            t = _valid(ids, ignore)
            where = ((t < 0) | (t >= vocab_size)).nonzero()[0].tolist()
            value = int(ids[tuple(where)])
            allowed = f"[0, {vocab_size})" + (f" or {ignore} (ignored)" if ignore is not None else "")
            raise ValueError(f"{name}[{', '.join(map(str, where))}] = {value} is outside the model's vocabulary: "
                             f"token ids must be in {allowed}. Check that the tokenizer's vocabulary fits the "
                             f"model's vocab_size ({vocab_size}) and that padding uses a valid id")


class PendingCheck:
    """A screened device micro-batch whose range check is read later (``resolve``), without a sync now."""

    def __init__(self, todo: list, vocab_size: int):
        self.todo, self.vocab_size = todo, vocab_size
        device_bounds = _bounds(todo)
        self.bounds = torch.empty(device_bounds.shape, dtype=device_bounds.dtype, pin_memory=True)
        self.bounds.copy_(device_bounds, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def resolve(self) -> None:
        """Wait for the bounds (long computed by now) and raise as ``check_micro_batch`` for a bad id."""
        self.ready.synchronize()
        _raise_if_out_of_range(self.todo, self.bounds.tolist(), self.vocab_size)


def screen_micro_batch(batch, vocab_size: int | None) -> tuple[dict, PendingCheck | None]:
    """``check_micro_batch`` for the engine's forward: ``(batch to compute with, pending check or None)``.

    On the host, or with autograd off (evaluation), the batch is checked now and returned as is. On a
    CUDA device with autograd on, types and emptiness are checked now; the range check is started and
    returned as a ``PendingCheck``, and the returned batch holds ``input_ids`` clamped to ``[0, V)`` and
    ``labels`` clamped to ``[0, V)`` except ``-100`` (the same tensors' values when they are valid), so
    no kernel indexes out of range before the check is read.

    Raises:
        TypeError / ValueError: as ``check_micro_batch`` (for a deferred check: from ``resolve``).
    """
    if not isinstance(batch, Mapping):
        check_micro_batch(batch, vocab_size)
    todo = [(key, batch[key], ignore) for key, ignore in (("input_ids", None), ("labels", IGNORE_INDEX))
            if batch.get(key) is not None]
    on_gpu = todo and all(torch.is_tensor(t) and t.is_cuda for _, t, _ in todo)
    if vocab_size is None or not on_gpu or not torch.is_grad_enabled():
        check_micro_batch(batch, vocab_size)
        return dict(batch), None
    _check_types(todo)
    safe = dict(batch)
    for name, ids, ignore in todo:
        clamped = ids.clamp(0, vocab_size - 1)
        safe[name] = clamped if ignore is None else torch.where(ids == ignore, ids, clamped)
    return safe, PendingCheck(todo, vocab_size)


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
