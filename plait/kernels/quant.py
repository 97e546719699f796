"""Optimizer states in lower precision: the state dtypes, the 8-bit maps and block layout, torch ops.

``state_dtype`` (``check_state_dtype``) stores Adam's two moments as ``"fp32"`` (8 bytes/param),
``"bf16"`` (4, round to nearest even) or ``"int8"``: blocks of at most :data:`BLOCK` = 256 elements, each
a float32 absmax ``s`` plus one uint8 index per element into a 256-entry dynamic map (:data:`SIGNED_MAP`
in ``[-1, 1]``, :data:`UNSIGNED_MAP` in ``[0, 1]``), read back as ``map[index] * s``: about 2.03
bytes/param (``state_nbytes``). Sources: Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
ICLR 2022, Sec. 2; the maps: Dettmers, ICLR 2016, Sec. 3.

``block_starts`` starts a block at every given boundary (ZeRO segments, parameter pieces); ``quantize_``
/ ``dequantize`` are the torch ops. These maps are the only definition, shared with the host kernels
(``cpu_adam_states``), which pick the same index for the same float32 input. Error bounds and the map
construction: ``docs/kernels.md``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

STATE_DTYPES = ("fp32", "bf16", "int8")
BLOCK = 256


def _dynamic_values(fraction_bits: int) -> np.ndarray:
    """Positive values of the dynamic code with ``fraction_bits`` bits after the sign (float64, sorted).

    For ``E`` leading zeros the code has ``fraction_bits - 1 - E`` bits of linear fraction: ``2^k`` values at
    the centres of ``2^k`` equal steps of ``[0.1, 1]``, times ``10^-E``.
    """
    out = []
    for e in range(fraction_bits):
        k = fraction_bits - 1 - e
        edges = np.linspace(0.1, 1.0, 2**k + 1)
        out.append((edges[:-1] + edges[1:]) / 2 * 10.0**-e)
    return np.sort(np.concatenate(out))


def _signed_map() -> np.ndarray:
    # 7 bits after the sign: 127 positive values; the smallest gives way to 1.0 so that +-s read back exactly
    pos = np.concatenate([_dynamic_values(7)[1:], [1.0]])
    return np.concatenate([-pos[::-1], [0.0], pos]).astype(np.float32)  # 255 values, index 127 is 0


def _unsigned_map() -> np.ndarray:
    # 8 bits, no sign: 255 positive values; the smallest gives way to 1.0, and 0 comes first
    return np.concatenate([[0.0], _dynamic_values(8)[1:], [1.0]]).astype(np.float32)  # 256 values


#: first moment: 255 float32 values in [-1, 1], sorted, symmetric, with 0 (index 127) and +-1
SIGNED_MAP = _signed_map()
#: second moment: 256 float32 values in [0, 1], sorted, with 0 (index 0) and 1
UNSIGNED_MAP = _unsigned_map()
SIGNED_MID = ((SIGNED_MAP[:-1].astype(np.float64) + SIGNED_MAP[1:]) / 2).astype(np.float32)
UNSIGNED_MID = ((UNSIGNED_MAP[:-1].astype(np.float64) + UNSIGNED_MAP[1:]) / 2).astype(np.float32)
SIGNED_ZERO = int(np.flatnonzero(SIGNED_MAP == 0)[0])


def _start_table(mid: np.ndarray) -> np.ndarray:
    """uint8 ``[65536]``: for each top half of a float32 bit pattern (sign, exponent, 7 mantissa bits) the count
    of midpoints below the smallest float32 with that top half. A code is then found from there by stepping
    past the few midpoints inside the range (``cpu_adam_states._code``): a range spans 2^-7 of its value,
    less than the relative spacing of either map, so it holds at most a couple of midpoints."""
    keys = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    keys[keys >= np.uint32(0x80000000)] |= np.uint32(
        0xFFFF
    )  # negative: the most negative of the range
    low = keys.view(np.float32)
    out = np.searchsorted(mid, np.nan_to_num(low, nan=0.0), side="left")
    return out.astype(np.uint8)


def _one_per_range(mid: np.ndarray) -> bool:
    """Whether no two midpoints share the top 16 bits of their float32 pattern (what ``_code`` relies on)."""
    tops = mid.view(np.uint32) >> np.uint32(16)
    return len(np.unique(tops)) == len(tops)


assert _one_per_range(SIGNED_MID) and _one_per_range(
    UNSIGNED_MID
)  # a property of the maps' spacing
SIGNED_START = _start_table(SIGNED_MID)
UNSIGNED_START = _start_table(UNSIGNED_MID)


def check_state_dtype(value, key: str = "optimizer.params.state_dtype") -> str:
    """``value`` if it is one of :data:`STATE_DTYPES`. Raises ValueError naming ``key`` and the choices."""
    if value not in STATE_DTYPES:
        raise ValueError(
            f"{key} = {value!r} is not one of {list(STATE_DTYPES)} (fp32: float32 Adam moments; bf16: "
            "bfloat16 moments; int8: 8-bit block-wise quantized moments)"
        )
    return value


def block_starts(numel: int, boundaries: Iterable[int] = (0,), block: int = BLOCK) -> np.ndarray:
    """int64 ``[blocks + 1]``: where each block starts, then ``numel``. A block starts at every boundary in
    ``[0, numel)`` and every ``block`` elements after one. Raises ValueError: a boundary outside ``[0, numel]``."""
    bounds = sorted({0, *(int(b) for b in boundaries)} - {numel})
    if bounds and (bounds[0] < 0 or bounds[-1] > numel):
        raise ValueError(f"block boundaries {bounds[0]}..{bounds[-1]} lie outside [0, {numel}]")
    runs = [np.arange(a, b, block, dtype=np.int64) for a, b in zip(bounds, bounds[1:] + [numel])]
    return np.concatenate(runs + [np.array([numel], dtype=np.int64)])


def state_nbytes(numel: int, state_dtype: str, blocks: int | None = None) -> int:
    """Bytes of Adam's two moments over ``numel`` elements (``blocks``: int8's block count, default full blocks)."""
    if state_dtype == "int8":
        return 2 * numel + 8 * (blocks if blocks is not None else -(-numel // BLOCK))
    return numel * (8 if state_dtype == "fp32" else 4)


# ---- torch ops: vectorized over blocks (any device) ----------------------------------------------------------
def _table(arr: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(arr).to(like.device)


def device_tables(starts: np.ndarray, device) -> dict[str, torch.Tensor]:
    """The maps (``smap``, ``umap``), midpoints (``smid``, ``umid``) and block ``lengths`` on ``device``: what the
    torch ops need, copied once per optimizer and device instead of at every call."""
    arrays = {
        "smap": SIGNED_MAP,
        "umap": UNSIGNED_MAP,
        "smid": SIGNED_MID,
        "umid": UNSIGNED_MID,
        "lengths": np.diff(starts),
    }
    return {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}


def block_lengths(starts: np.ndarray, device) -> torch.Tensor:
    """int64 ``[blocks]`` block lengths from :func:`block_starts` output, on ``device``."""
    return torch.from_numpy(np.diff(starts)).to(device)


def dequantize(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    lengths: torch.Tensor,
    signed: bool,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``[n]`` values of uint8 ``codes [n]`` with per-block scales ``absmax [blocks]`` (float32) over
    blocks of ``lengths [blocks]`` (summing to n): ``map[code] * absmax[block]``. ``table``: the map already on
    ``codes``' device (None: copied there)."""
    table = _table(SIGNED_MAP if signed else UNSIGNED_MAP, codes) if table is None else table
    return table[codes.long()] * torch.repeat_interleave(absmax, lengths, output_size=codes.numel())


def quantize_(
    x: torch.Tensor,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    lengths: torch.Tensor,
    signed: bool,
    mid: torch.Tensor | None = None,
) -> None:
    """Write float32 ``x [n]`` into uint8 ``codes [n]`` and float32 ``absmax [blocks]`` in place: each block's
    scale is its largest ``|x|`` (1 where that is 0), each code the nearest map value of ``x / scale``.
    ``mid``: the map's midpoints already on ``x``'s device (None: copied there)."""
    amax = (
        torch.segment_reduce(x.abs(), "max", lengths=lengths, unsafe=True) if x.numel() else absmax
    )
    absmax.copy_(amax)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = x / torch.repeat_interleave(scale, lengths, output_size=x.numel())
    mid = _table(SIGNED_MID if signed else UNSIGNED_MID, x) if mid is None else mid
    codes.copy_(torch.bucketize(y, mid).to(torch.uint8))
