"""Checks of a micro-batch at the engine's edge, before any rank computes with it.

A token id outside the vocabulary does not fail where it is used: the vocabulary-parallel embedding and
cross entropy (tp > 1) mask it and train on silently, torch's embedding at tp = 1 raises a bare
``IndexError`` on the CPU and a device-side assert on CUDA, and a label past the vocabulary gives an
``inf`` loss. So the engine checks every micro-batch here first. Cost: one min/max reduction per tensor;
a tensor still on the host costs no device synchronization, one on a device costs one per micro-batch
(``benchmarks/results/`` has the measured cost).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from plait.data.masking import IGNORE_INDEX


def check_token_ids(ids: torch.Tensor, name: str, vocab_size: int, ignore_index: int | None = None) -> None:
    """Raise unless ``ids`` (integer token ids, any shape, e.g. ``[b, s]``) lie in ``[0, vocab_size)``.

    Args:
        ids: the tensor to check. name: its key in the batch, for the message.
        vocab_size: the model's vocabulary size V. ignore_index: a value also allowed (labels: -100).

    Raises:
        TypeError: ``ids`` is not an integer tensor (float ids, say), naming its dtype.
        ValueError: an empty tensor, or an id outside the range, naming the id, its position
            (``name[row, column]``) and V.
    """
    _check_all([(name, ids, ignore_index)], vocab_size)


def check_micro_batch(batch, vocab_size: int | None) -> None:
    """Check one micro-batch dict: ``input_ids`` in ``[0, V)``, ``labels`` in ``[0, V)`` or -100, with one
    host synchronization for both when they are on a device.

    Args:
        batch: the micro-batch (``input_ids [b, s]``, ``labels [b, s]``, other model inputs).
        vocab_size: V, or None when the model does not state it (then only the types are checked).

    Raises:
        TypeError / ValueError: as ``check_token_ids``; a batch that is not a dict.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"a micro-batch is a dict of model inputs (input_ids [b, s], labels [b, s], ...), got "
                        f"{type(batch).__name__}")
    todo = [(key, batch[key], ignore) for key, ignore in (("input_ids", None), ("labels", IGNORE_INDEX))
            if batch.get(key) is not None]
    _check_all(todo, vocab_size if vocab_size is not None else 2 ** 62)


def _check_all(todo: list, vocab_size: int) -> None:
    for name, ids, _ in todo:
        if not torch.is_tensor(ids) or ids.dtype.is_floating_point or ids.is_complex() or ids.dtype == torch.bool:
            got = ids.dtype if torch.is_tensor(ids) else type(ids).__name__
            raise TypeError(f"{name} must be an integer tensor of token ids (torch.long), got {got}; "
                            f"tokenize to integers, or .long() a float tensor that holds whole numbers")
        if ids.numel() == 0:
            raise ValueError(f"{name} is empty (shape {list(ids.shape)}): a micro-batch needs at least one token")
    if not todo:
        return
    # min and max of every tensor (ignored labels counted as 0), read back together: one synchronization
    valid = [ids if ignore is None else ids.masked_fill(ids == ignore, 0) for _, ids, ignore in todo]
    bounds = torch.stack([v for t in valid for v in torch.aminmax(t.to(valid[0].device))]).tolist()
    for (name, ids, ignore), t, lo, hi in zip(todo, valid, bounds[::2], bounds[1::2]):
        if lo < 0 or hi >= vocab_size:
            where = ((t < 0) | (t >= vocab_size)).nonzero()[0].tolist()
            value = int(ids[tuple(where)])
            allowed = f"[0, {vocab_size})" + (f" or {ignore} (ignored)" if ignore is not None else "")
            raise ValueError(f"{name}[{', '.join(map(str, where))}] = {value} is outside the model's vocabulary: "
                             f"token ids must be in {allowed}. Check that the tokenizer's vocabulary fits the "
                             f"model's vocab_size ({vocab_size}) and that padding uses a valid id")
