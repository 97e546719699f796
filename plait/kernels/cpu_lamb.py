"""LAMB on the host over flat float32 buffers, fused with the bf16/fp16 copy-out (numba).

You et al. 2019/2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
Algorithm 2, with the trust ratio of each *parameter tensor* (a segment of the flat buffer)::

    g   = grad * grad_coef
    m   = beta1 * m + (1 - beta1) * g
    v   = beta2 * v + (1 - beta2) * g * g
    u   = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w        bc_k = 1 - beta_k^t, or 1 when off
    r   = ||w|| / ||u|| over the segment (before the update); r = 1 if either norm is 0
    w   = w - lr * r * u

Choices, as in NVIDIA's FusedLAMB (apex ``multi_tensor_lamb``) with ``use_nvlamb=True``: bias
correction is applied to ``m`` and ``v`` (the paper's Alg. 2 writes it; BERT's original TF code
omits it; ``bias_correction=False`` gives that), eps is added outside the square root, weight decay
is decoupled (added to the update, so it is scaled by the trust ratio), the trust ratio uses the
identity scaling function phi with no clipping, and it is applied to every segment even when
``weight_decay == 0``. Global gradient-norm clipping is the caller's (pass the coefficient in
``grad_coef``).

Two passes, no scratch buffer of ``numel``: pass 1 updates ``m, v`` and accumulates ``||w||^2`` and
``||u||^2`` (float64) per chunk; pass 2 recomputes ``u`` from the stored ``m, v`` (bit-identical) and
applies it. Chunks never cross segments and are fixed by the segment offsets alone, so results do
not depend on the thread count or on stepping by bucket.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from plait.kernels.base import FlatOptimizer
from plait.kernels.lowp import MODE_BF16, MODE_FP16, as_f32, bf16_bits, fp16_bits


@njit(cache=True, inline="always", error_model="numpy")
def _lamb_update(w, m, v, hp):
    bc1, bc2, eps, weight_decay = hp
    return (m / bc1) / (np.sqrt(v / bc2) + eps) + weight_decay * w


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def lamb_moments_kernel(p, g, m, v, starts, ends, w_sq, u_sq, beta1, one_minus_beta1, beta2, one_minus_beta2,
                        grad_coef, hp):
    """Pass 1: update ``m, v`` (float32 ``[n]``) and write per-chunk ``sum w^2``, ``sum u^2`` (float64 ``[chunks]``).

    Chunk ``c`` covers ``[starts[c], ends[c])`` of the slice.
    """
    for c in prange(starts.shape[0]):
        sw = 0.0
        su = 0.0
        i = starts[c]
        e = ends[c]
        while i < e:
            grad = as_f32(g[i]) * grad_coef
            mi = beta1 * m[i] + one_minus_beta1 * grad
            vi = beta2 * v[i] + one_minus_beta2 * (grad * grad)
            m[i] = mi
            v[i] = vi
            w = p[i]
            u = _lamb_update(w, mi, vi, hp)
            sw += np.float64(w) * np.float64(w)
            su += np.float64(u) * np.float64(u)
            i += 1
        w_sq[c] = sw
        u_sq[c] = su


@njit(cache=True, error_model="numpy")
def lamb_chunk_scales(w_sq, u_sq, chunk_seg, n_seg, lr):
    """Per-chunk ``float32(lr * trust_ratio)`` of its segment from the per-chunk squared sums, in fixed order."""
    seg_w = np.zeros(n_seg)
    seg_u = np.zeros(n_seg)
    for c in range(w_sq.shape[0]):
        seg_w[chunk_seg[c]] += w_sq[c]
        seg_u[chunk_seg[c]] += u_sq[c]
    scale = np.empty(w_sq.shape[0], np.float32)
    for c in range(w_sq.shape[0]):
        s = chunk_seg[c]
        r = 1.0
        if seg_w[s] > 0.0 and seg_u[s] > 0.0:
            r = np.sqrt(seg_w[s]) / np.sqrt(seg_u[s])
        scale[c] = np.float32(lr * r)
    return scale


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def lamb_apply_kernel(p, m, v, out, mode, nan_bits, starts, ends, scale, hp):
    """Pass 2: ``w -= scale[c] * u`` over each chunk, writing ``out`` (uint16 ``[n]`` or ``[0]``) too."""
    for c in prange(starts.shape[0]):
        s = scale[c]
        if mode == MODE_BF16:
            for i in range(starts[c], ends[c]):
                w = p[i] - s * _lamb_update(p[i], m[i], v[i], hp)
                p[i] = w
                out[i] = bf16_bits(w, nan_bits)
        elif mode == MODE_FP16:
            for i in range(starts[c], ends[c]):
                w = p[i] - s * _lamb_update(p[i], m[i], v[i], hp)
                p[i] = w
                out[i] = fp16_bits(w)
        else:
            for i in range(starts[c], ends[c]):
                p[i] = p[i] - s * _lamb_update(p[i], m[i], v[i], hp)


def _chunks(offsets: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts, ends, segment id)`` of chunks of at most ``chunk`` elements, none crossing a segment."""
    starts, ends, seg = [], [], []
    for s in range(len(offsets) - 1):
        a, b = int(offsets[s]), int(offsets[s + 1])
        for c in range(a, b, chunk):
            starts.append(c)
            ends.append(min(c + chunk, b))
            seg.append(s)
    return (np.asarray(starts, np.int64), np.asarray(ends, np.int64), np.asarray(seg, np.int64))


class CPULAMB(FlatOptimizer):
    """LAMB (You et al. 2019, Alg. 2) over one flat float32 buffer of several parameter tensors.

    Args:
        params: the flat float32 master buffer ``[numel]`` (only its size is used) or ``numel``.
        segment_offsets: ``[n_tensors + 1]`` ints, ``0 = o_0 <= o_1 <= ... = numel``; tensor ``k`` is
            ``[o_k, o_{k+1})``. Its trust ratio ``||w_k|| / ||u_k||`` is computed over that segment.
        lr, betas, eps, weight_decay: as in the module docstring (eps outside the square root).
        bias_correction: divide ``m, v`` by ``1 - beta^t`` (True, paper and apex) or not (BERT TF code).
        num_threads: numba threads used inside each call (None: all).
        chunk: elements per parallel work item (a fixed partition, so results are thread-count free).

    State: ``exp_avg``, ``exp_avg_sq`` float32 ``[numel]`` torch tensors, ``step_count`` int.
    :meth:`step_range` ranges must start and end on segment offsets.

    Raises:
        ValueError: offsets not starting at 0, not ending at numel, or decreasing; bad betas/eps/decay.
    """

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, segment_offsets, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                 num_threads: int | None = None, chunk: int = 32768):
        super().__init__(params, lr, num_threads)
        offs = np.asarray(segment_offsets.tolist() if isinstance(segment_offsets, torch.Tensor) else segment_offsets,
                          dtype=np.int64).reshape(-1)
        if offs.shape[0] < 2 or offs[0] != 0 or offs[-1] != self.numel or np.any(np.diff(offs) < 0):
            raise ValueError(
                f"segment_offsets must rise from 0 to numel={self.numel} (one more entry than tensors), got "
                f"{len(offs)} entries starting {offs[:3].tolist()} and ending {offs[-2:].tolist()}"
            )
        if chunk < 1:
            raise ValueError(f"chunk={chunk} must be >= 1")
        self.segment_offsets = offs
        self._starts, self._ends, self._seg = _chunks(offs, int(chunk))
        self._set_hparams({"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps,
                           "weight_decay": weight_decay, "bias_correction": bias_correction})

    def _hparams(self) -> dict:
        return {**self._moment_hparams(), "bias_correction": self.bias_correction}

    def _set_hparams(self, hp: dict) -> None:
        self._set_moment_hparams(hp)
        self.bias_correction = bool(hp["bias_correction"])

    def _check_range(self, offset: int, length: int) -> None:
        offs = self.segment_offsets
        for x in (offset, offset + length):
            k = int(np.searchsorted(offs, x))
            if k >= len(offs) or offs[k] != x:
                lo, hi = offs[max(k - 1, 0)], offs[min(k, len(offs) - 1)]
                raise ValueError(
                    f"LAMB range [{offset}, {offset + length}) cuts parameter tensor [{lo}, {hi}) at {x}: its "
                    "trust ratio needs the whole tensor; make bucket boundaries fall on segment offsets"
                )

    def _run(self, p, g, states, bits, mode, offset, length, grad_coef) -> None:
        c0 = int(np.searchsorted(self._starts, offset))
        c1 = int(np.searchsorted(self._starts, offset + length))
        starts, ends = self._starts[c0:c1] - offset, self._ends[c0:c1] - offset
        seg = self._seg[c0:c1]
        (b1, b2), t, f = self.betas, self.step_count, np.float32
        bc1 = 1.0 - b1 ** t if self.bias_correction else 1.0
        bc2 = 1.0 - b2 ** t if self.bias_correction else 1.0
        hp = (f(bc1), f(bc2), f(self.eps), f(self.weight_decay))
        w_sq = np.empty(c1 - c0)
        u_sq = np.empty(c1 - c0)
        m, v = states
        lamb_moments_kernel(p, g, m, v, starts, ends, w_sq, u_sq, f(b1), f(1.0 - b1), f(b2), f(1.0 - b2),
                            grad_coef, hp)
        seg0 = int(seg[0]) if len(seg) else 0
        scale = lamb_chunk_scales(w_sq, u_sq, seg - seg0, int(seg[-1]) - seg0 + 1 if len(seg) else 0,
                                  float(self._step_lr))
        lamb_apply_kernel(p, m, v, bits, mode, self._nan_bits, starts, ends, scale, hp)
