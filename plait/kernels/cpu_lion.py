"""Lion on the host over flat float32 buffers, fused with the bf16/fp16 copy-out (numba).

Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2 (Lion with decoupled
weight decay). Per element, with ``g = grad * grad_coef`` (float32)::

    c = beta1 * m + (1 - beta1) * g
    w = w - lr * (sign(c) + wd * w)            sign(0) = 0
    m = beta2 * m + (1 - beta2) * g
    out = round_nearest_even(w) to bf16/fp16    (when a low-precision copy is given)

Lion has no bias correction and no epsilon. The paper suggests an lr 3-10x smaller and a weight
decay 3-10x larger than AdamW's.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from plait.kernels.base import FlatOptimizer
from plait.kernels.lowp import MODE_BF16, MODE_FP16, as_f32, bf16_bits, fp16_bits


@njit(cache=True, inline="always", error_model="numpy")
def _lion_elem(w, grad, m, hp):
    lr, beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay, grad_coef = hp
    grad = grad * grad_coef
    c = beta1 * m + one_minus_beta1 * grad
    s = np.float32(0.0)
    if c > np.float32(0.0):
        s = np.float32(1.0)
    elif c < np.float32(0.0):
        s = np.float32(-1.0)
    elif np.isnan(c):  # NaN propagates, as torch.sign
        s = c
    w = w - lr * (s + weight_decay * w)
    return w, beta2 * m + one_minus_beta2 * grad


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def lion_kernel(
    p,
    g,
    m,
    out,
    mode,
    nan_bits,
    lr,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    weight_decay,
    grad_coef,
):
    """One Lion step over ``p, g, m`` (float32 ``[n]``), writing ``out`` (uint16 ``[n]`` or ``[0]``).

    Scalars are float32 except ``mode`` (int) and ``nan_bits`` (uint16).
    """
    n = p.shape[0]
    hp = (lr, beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay, grad_coef)
    if mode == MODE_BF16:
        for i in prange(n):
            w, m[i] = _lion_elem(p[i], as_f32(g[i]), m[i], hp)
            p[i] = w
            out[i] = bf16_bits(w, nan_bits)
    elif mode == MODE_FP16:
        for i in prange(n):
            w, m[i] = _lion_elem(p[i], as_f32(g[i]), m[i], hp)
            p[i] = w
            out[i] = fp16_bits(w)
    else:
        for i in prange(n):
            p[i], m[i] = _lion_elem(p[i], as_f32(g[i]), m[i], hp)


class CPULion(FlatOptimizer):
    """Lion (Chen et al. 2023, Alg. 2) over one flat float32 buffer on the host, numba-parallel.

    Args:
        params: the flat float32 master buffer ``[numel]`` (only its size is used) or ``numel``.
        lr: learning rate (each element moves by exactly ``lr`` per step, plus decay).
        betas: ``(beta1, beta2)`` in [0, 1): interpolation for the update sign, and momentum decay.
        weight_decay: decoupled, ``w -= lr * wd * w``.
        num_threads: numba threads used inside each call (None: all).

    State: ``exp_avg`` float32 ``[numel]`` torch tensor, ``step_count`` int.

    Raises:
        ValueError: betas outside [0, 1), negative lr or weight_decay.
    """

    _state_names = ("exp_avg",)

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        num_threads: int | None = None,
    ):
        super().__init__(params, lr, num_threads)
        self._set_hparams(
            {"lr": lr, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay}
        )

    def _hparams(self) -> dict:
        return self._moment_hparams()

    def _set_hparams(self, hp: dict) -> None:
        self._set_moment_hparams(hp)

    def _run(self, p, g, states, bits, mode, offset, length, grad_coef) -> None:
        (b1, b2), f = self.betas, np.float32
        lion_kernel(
            p,
            g,
            states[0],
            bits,
            mode,
            self._nan_bits,
            f(self._step_lr),
            f(b1),
            f(1.0 - b1),
            f(b2),
            f(1.0 - b2),
            f(self.weight_decay),
            grad_coef,
        )
