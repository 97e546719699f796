"""Functions several test files share: the relative error, tiny model configs and micro-batches.

Imported as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path`` for the test
modules and the processes they spawn; ``tests/gpu/*.py`` insert it themselves), like
``reference_models``. Plain functions only: no state.
"""

from __future__ import annotations

import torch

from plait.layers import TransformerConfig
from plait.models import preset


def rel_err(a: torch.Tensor, b: torch.Tensor, *, floor: float = 0.0, norm: str = "l2") -> float:
    """Relative error of ``a`` against the reference ``b``, computed in float64.

    ``norm="l2"``: ``||a - b||_2 / max(||b||_2, floor)`` over all elements (``floor`` > 0 keeps a
    near-zero reference from inflating it); ``norm="max"``: ``max|a - b| / max|b|`` (``floor``
    unused). A zero reference with ``floor=0`` gives inf or nan.

    Raises:
        ValueError: an unknown ``norm``.
    """
    a, b = a.double(), b.double()
    if norm == "max":
        return ((a - b).abs().max() / b.abs().max()).item()
    if norm != "l2":
        raise ValueError(f"unknown norm {norm!r}; use 'l2' or 'max'")
    den = b.norm().clamp_min(floor) if floor else b.norm()
    return ((a - b).norm() / den).item()


def tiny(arch: str = "llama", **overrides) -> TransformerConfig:
    """A 2-block ``<arch>-tiny`` preset with vocabulary 257 and hidden size 32 (4 heads; Llama: 2 kv
    heads and an MLP of 48), with ``overrides`` applied."""
    base = dict(vocab_size=257, num_layers=2, hidden_size=32, num_heads=4)
    if arch == "llama":
        base.update(num_kv_heads=2, ffn_hidden_size=48)
    return preset(f"{arch}-tiny", **{**base, **overrides})


def make_config(arch: str, **overrides) -> TransformerConfig:
    """The 3-block parity model of ``<arch>-tiny``: vocabulary 1001 (padded on the last tp rank), hidden
    64, 4 heads (Llama: 8 heads on 4 kv heads, MLP 160), 64 positions, no dropout; then ``overrides``."""
    base = dict(
        vocab_size=1001,
        num_layers=3,
        hidden_size=64,
        num_heads=4,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if arch == "llama":
        base.update(
            num_heads=8, num_kv_heads=4, ffn_hidden_size=160
        )  # GQA: 2 query heads per kv head
    return preset(f"{arch}-tiny", **{**base, **overrides})


def micro_batch(
    step: int, j: int, dp_rank: int, *, vocab_size: int = 257, micro: int = 2, seq: int = 16
) -> dict:
    """Micro-batch ``j`` of optimizer step ``step`` on data-parallel rank ``dp_rank``: ``input_ids`` and
    next-token ``labels``, both ``[micro, seq]`` int64 in ``[0, vocab_size)``, seeded by the three
    indices (the same on every call)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * j + dp_rank)
    ids = torch.randint(0, vocab_size, (micro, seq + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
