"""float32 -> bfloat16 / float16 rounding as bit patterns, for the optimizers' fused copy-out.

The optimizer kernels write the updated low-precision weights in the same pass as the fp32 update, as
``uint16`` bit patterns into a ``uint16`` view of the destination (``lowp_bits_view``; numba has no
bfloat16). ``bf16_bits`` and ``fp16_bits`` equal torch's CPU ``Tensor.to(dtype)`` bit for bit: round to
nearest even (IEEE 754-2019, 4.3.1), overflow to inf, signed zeros, subnormals and NaN patterns (bf16's
NaN pattern is torch's, asked by ``torch_bf16_nan_bits``). Also the buffer views the kernels read
(``flat_f32``, ``grad_view``) and ``sum_of_squares``. Modes of every kernel: :data:`MODE_NONE`,
:data:`MODE_BF16`, :data:`MODE_FP16`. The corner cases one by one: ``docs/kernels.md``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

MODE_NONE = 0
MODE_BF16 = 1
MODE_FP16 = 2

_U16 = {torch.bfloat16: MODE_BF16, torch.float16: MODE_FP16}


@njit(cache=True, inline="always", error_model="numpy")
def bf16_bits(x, nan_bits):
    """bfloat16 bit pattern (uint16) of float32 ``x``, round to nearest even.

    Adding ``0x7FFF + lsb`` to the float32 bits and dropping the low 16 bits rounds the mantissa to
    8 bits with ties to even; a carry out of the mantissa bumps the exponent, so the largest finite
    values round up to ``inf`` (``0x7F80``) exactly as IEEE requires. NaN maps to ``nan_bits``.
    """
    u = np.float32(x).view(np.uint32)
    r = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        r = nan_bits
    return r


def as_f32(x):
    """float32 value of a gradient element: a float32 as is, or a bfloat16 given as its uint16 bit
    pattern (widened exactly: the bits become the high half of a float32). Callable from numba only."""
    raise NotImplementedError("as_f32 is a numba intrinsic; call it inside @njit code")


@overload(as_f32, inline="always")
def _as_f32_impl(x):
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    if isinstance(x, types.Integer) and x.bitwidth == 16 and not x.signed:
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    return None


@njit(cache=True, inline="always", error_model="numpy")
def fp16_bits(x):
    """IEEE binary16 bit pattern (uint16) of float32 ``x``, round to nearest even.

    Normal range: re-bias the exponent (127 -> 15, i.e. subtract ``112 << 23``) and round the
    mantissa from 23 to 10 bits. ``|x| >= 65520`` rounds to ``inf``. ``|x| < 2^-14`` becomes a
    subnormal: the 24-bit significand is shifted right by ``126 - exponent`` with explicit
    round-half-even. NaN: sign kept, quiet bit set, top 10 payload bits kept (x86 F16C).
    """
    u = np.float32(x).view(np.uint32)
    sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
    a = u & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):  # NaN
        return np.uint16(sign | np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF)))
    if a >= np.uint32(0x477FF000):  # >= 65520 (incl. inf): rounds to inf
        return np.uint16(sign | np.uint32(0x7C00))
    if a >= np.uint32(0x38800000):  # >= 2^-14: normal half
        b = a - np.uint32(0x38000000)
        return np.uint16(
            sign | ((b + np.uint32(0xFFF) + ((b >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13))
        )
    if a <= np.uint32(0x33000000):  # <= 2^-25: rounds to (signed) zero, 2^-25 being a tie to even
        return np.uint16(sign)
    e = a >> np.uint32(23)
    m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    shift = np.uint32(126) - e  # 14..24 here
    q = m >> shift
    rem = m & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    if rem > half or (rem == half and (q & np.uint32(1)) == np.uint32(1)):
        q += np.uint32(1)
    return np.uint16(sign | q)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _convert(src, out, mode, nan_bits):
    for i in prange(src.shape[0]):
        if mode == MODE_BF16:
            out[i] = bf16_bits(src[i], nan_bits)
        else:
            out[i] = fp16_bits(src[i])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _sum_squares(x):
    total = 0.0
    for i in prange(x.shape[0]):
        v = np.float64(as_f32(x[i]))
        total += v * v
    return total


def sum_of_squares(x: torch.Tensor) -> float:
    """``sum(x**2)`` of a contiguous CPU float32 or bfloat16 tensor, accumulated in float64 (numba-parallel).

    The host half of ZeRO-Offload needs each gradient segment's squared norm (clipping) and whether it
    is finite (fp16 overflow); this reads bf16 gradients without widening them first. inf/nan in ``x``
    give an inf/nan result. Summation order depends on the thread count (float64, so at most ~1e-16
    relative apart).

    Raises:
        TypeError: another dtype. ValueError: non-contiguous or non-CPU tensor.
    """
    return float(_sum_squares(grad_view(x, "x")))


def flat_f32(x, name: str) -> np.ndarray:
    """Zero-copy 1-D float32 numpy view of a contiguous CPU float32 torch tensor or numpy array.

    Raises:
        TypeError: wrong type or dtype. ValueError: non-contiguous or non-CPU tensor.
    """
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be torch.float32, got {x.dtype}")
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous CPU tensor (device={x.device}, contiguous={x.is_contiguous()})"
            )
        return x.detach().reshape(-1).numpy()
    if isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        return x.reshape(-1)
    raise TypeError(f"{name} must be a torch tensor or numpy array, got {type(x).__name__}")


def grad_view(x, name: str) -> np.ndarray:
    """Zero-copy 1-D numpy view of gradients for the kernels: float32 as float32 (:func:`flat_f32`),
    bfloat16 as its uint16 bit patterns (the kernels widen them with :func:`as_f32`).

    Args:
        x: contiguous CPU torch tensor (float32 or bfloat16) or numpy float32 array.

    Raises:
        TypeError: another dtype or type. ValueError: non-contiguous or non-CPU tensor.
    """
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16):
        return flat_f32(x, name)
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous CPU tensor (device={x.device}, contiguous={x.is_contiguous()})"
        )
    return x.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16)


def torch_bf16_nan_bits() -> int:
    """The uint16 pattern torch's CPU ``.to(torch.bfloat16)`` writes for NaN (``0xFFFF`` on x86)."""
    x = torch.full((64,), float("nan"))
    return int(x.to(torch.bfloat16).view(torch.int16)[0].item()) & 0xFFFF


def lowp_bits_view(out) -> tuple[np.ndarray, int]:
    """``(uint16 numpy view, mode)`` of a low-precision destination, sharing its memory.

    Args:
        out: None (-> empty array, :data:`MODE_NONE`), a contiguous CPU torch tensor of dtype
            ``torch.bfloat16`` or ``torch.float16``, or a contiguous numpy ``float16`` array.

    Raises:
        TypeError: any other dtype or type. ValueError: non-contiguous or non-CPU tensors.
    """
    if out is None:
        return np.empty(0, np.uint16), MODE_NONE
    if isinstance(out, np.ndarray):
        if out.dtype != np.float16:
            raise TypeError(f"low-precision output must be numpy float16, got {out.dtype}")
        if not out.flags.c_contiguous:
            raise ValueError(
                "low-precision output array must be C-contiguous; pass np.ascontiguousarray(out)"
            )
        return out.reshape(-1).view(np.uint16), MODE_FP16
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"low-precision output must be a torch tensor or numpy array, got {type(out).__name__}"
        )
    if out.dtype not in _U16:
        raise TypeError(
            f"low-precision output must be torch.bfloat16 or torch.float16, got {out.dtype}"
        )
    if out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(
            f"low-precision output must be a contiguous CPU tensor (device={out.device}, "
            f"contiguous={out.is_contiguous()}); copy it to a contiguous host buffer first"
        )
    return out.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16), _U16[out.dtype]


def copy_to_lowp(src: torch.Tensor, out, nan_bits: int | None = None) -> None:
    """Write ``src`` (float32, any shape, contiguous CPU) rounded to bf16/fp16 into ``out`` in place.

    Equal bit for bit to ``out.copy_(src.to(out.dtype))`` (see the module docstring), parallel over
    numba's threads. ``out`` as in :func:`lowp_bits_view` (not None) with ``src.numel()`` elements.

    Raises:
        ValueError: element counts differ, or ``src`` is not contiguous float32.
    """
    if src.dtype != torch.float32 or not src.is_contiguous():
        raise ValueError(
            f"src must be contiguous float32, got dtype={src.dtype}, contiguous={src.is_contiguous()}"
        )
    bits, mode = lowp_bits_view(out)
    if mode == MODE_NONE:
        raise ValueError("out is None: nothing to copy into")
    if bits.shape[0] != src.numel():
        raise ValueError(f"out has {bits.shape[0]} elements but src has {src.numel()}")
    nan = torch_bf16_nan_bits() if nan_bits is None else nan_bits
    _convert(src.detach().reshape(-1).numpy(), bits, mode, np.uint16(nan))
