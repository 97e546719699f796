"""Masked-language-model corruption of token ids (BERT pretraining)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

IGNORE_INDEX = (
    -100
)  # labels ignored by torch.nn.functional.cross_entropy (its default ignore_index)


def mask_tokens(
    input_ids: torch.Tensor,
    mask_id: int,
    vocab_size: int,
    special_ids: Iterable[int] = (),
    prob: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking (Devlin et al. 2019, "BERT", section 3.1 "Task #1: Masked LM").

    Every token whose id is not in ``special_ids`` is selected independently with probability
    ``prob``. A selected token becomes ``mask_id`` with probability 0.8, a uniformly random
    non-special id with probability 0.1, and stays unchanged with probability 0.1. Labels are
    the original ids at selected positions and ``-100`` (ignored by cross-entropy) elsewhere.

    Args:
        input_ids: integer ids, any shape, e.g. ``[batch, seq]``; not modified.
        mask_id: id of ``[MASK]``.
        vocab_size: ids are in ``[0, vocab_size)``; random replacements are drawn from there.
        special_ids: ids never selected nor drawn as replacements ([PAD], [CLS], [SEP], ...).
        prob: selection probability in [0, 1].
        generator: torch CPU generator for reproducible masks.

    Returns ``(masked_ids, labels)``, both int64 with the shape of ``input_ids``.
    Raises ValueError if ``prob`` is outside [0, 1], ``mask_id`` or an input id is outside the
    vocabulary, or every id is special (nothing to draw random replacements from).
    """
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"prob={prob} must be in [0, 1]")
    if not 0 <= mask_id < vocab_size:
        raise ValueError(f"mask_id={mask_id} is outside the vocabulary [0, {vocab_size})")
    ids = input_ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"input ids span [{int(ids.min())}, {int(ids.max())}], outside the vocabulary [0, {vocab_size})"
        )
    special = torch.zeros(vocab_size, dtype=torch.bool)
    special[[int(s) for s in special_ids]] = True
    allowed = (~special).nonzero().squeeze(1)
    if allowed.numel() == 0:
        raise ValueError(
            f"all {vocab_size} ids are special: no id to draw random replacements from"
        )
    dev = ids.device
    u_select = torch.rand(ids.shape, generator=generator)
    u_action = torch.rand(ids.shape, generator=generator)
    random_pick = allowed[torch.randint(allowed.numel(), ids.shape, generator=generator)]
    is_special = special[ids.cpu()]
    selected = (u_select < prob) & ~is_special
    masked = ids.cpu().clone()
    masked[selected & (u_action < 0.8)] = mask_id
    to_random = selected & (u_action >= 0.8) & (u_action < 0.9)
    masked[to_random] = random_pick[to_random]
    labels = torch.where(selected, ids.cpu(), torch.full_like(masked, IGNORE_INDEX))
    return masked.to(dev), labels.to(dev)
