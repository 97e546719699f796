"""Adam / AdamW on the host over flat float32 buffers, fused with the bf16/fp16 copy-out (numba).

Kingma & Ba 2015, Algorithm 1, step size folded as in torch.optim.Adam; weight decay as an L2 term
(``adamw_mode=False``) or decoupled (``adamw_mode=True``, Loshchilov & Hutter 2019, as torch.optim.AdamW).
Per element ``i`` and step ``t`` (all float32; ``g = grad * grad_coef``)::

    adamw: w = w * (1 - lr*wd)        adam: g = g + wd * w
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    w = w - (lr / bc1) * (m / (sqrt(v) / sqrt(bc2) + eps))      bc_k = 1 - beta_k^t (or 1 when off)
    out = round_nearest_even(w) to bf16/fp16                      (when a low-precision copy is given)

Sources and the flat-buffer design: ``docs/kernels.md``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from plait.kernels.base import FlatOptimizer
from plait.kernels.lowp import MODE_BF16, MODE_FP16, as_f32, bf16_bits, fp16_bits


@njit(cache=True, inline="always", error_model="numpy")
def _adam_elem(w, grad, m, v, hp):
    (
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
        weight_decay,
        decay,
        decoupled,
        step_size,
        bc2_sqrt,
        grad_coef,
    ) = hp
    grad = grad * grad_coef
    if decoupled:
        w = w * decay
    elif weight_decay != np.float32(0.0):
        grad = grad + weight_decay * w
    m = beta1 * m + one_minus_beta1 * grad
    v = beta2 * v + one_minus_beta2 * (grad * grad)
    denom = np.sqrt(v) / bc2_sqrt + eps
    return w - step_size * (m / denom), m, v


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def adam_kernel(
    p,
    g,
    m,
    v,
    out,
    mode,
    nan_bits,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    decay,
    decoupled,
    step_size,
    bc2_sqrt,
    grad_coef,
):
    """One Adam/AdamW step over ``p, g, m, v`` (float32 ``[n]``), writing ``out`` (uint16 ``[n]`` or ``[0]``).

    Scalars are float32 except ``mode`` (int), ``nan_bits`` (uint16) and ``decoupled`` (bool);
    ``decay = 1 - lr * weight_decay``, ``step_size = lr / bc1``. One loop per copy-out mode, so each
    loop body is branch-free and vectorizes.
    """
    n = p.shape[0]
    hp = (
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
        weight_decay,
        decay,
        decoupled,
        step_size,
        bc2_sqrt,
        grad_coef,
    )
    if mode == MODE_BF16:
        for i in prange(n):
            w, m[i], v[i] = _adam_elem(p[i], as_f32(g[i]), m[i], v[i], hp)
            p[i] = w
            out[i] = bf16_bits(w, nan_bits)
    elif mode == MODE_FP16:
        for i in prange(n):
            w, m[i], v[i] = _adam_elem(p[i], as_f32(g[i]), m[i], v[i], hp)
            p[i] = w
            out[i] = fp16_bits(w)
    else:
        for i in prange(n):
            p[i], m[i], v[i] = _adam_elem(p[i], as_f32(g[i]), m[i], v[i], hp)


class CPUAdam(FlatOptimizer):
    """Adam or AdamW over one flat float32 buffer on the host (ZeRO-Offload), numba-parallel.

    Args:
        params: the flat float32 master buffer ``[numel]`` (only its size is used) or ``numel``.
        lr: learning rate. betas: ``(beta1, beta2)``, each in [0, 1). eps: added to ``sqrt(v_hat)``.
        weight_decay: decoupled (``adamw_mode=True``, torch.optim.AdamW) or L2 (``False``, torch.optim.Adam).
        bias_correction: divide by ``1 - beta^t`` (True, as torch) or not.
        num_threads: numba threads used inside each call (None: all).

    State: ``exp_avg``, ``exp_avg_sq`` float32 ``[numel]`` torch tensors, ``step_count`` int.
    Matches torch.optim.Adam/AdamW (float32, foreach=False) to float32 rounding.

    Raises:
        ValueError: betas outside [0, 1), negative lr, eps or weight_decay.
    """

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        num_threads: int | None = None,
    ):
        super().__init__(params, lr, num_threads)
        self._set_hparams(
            {
                "lr": lr,
                "beta1": betas[0],
                "beta2": betas[1],
                "eps": eps,
                "weight_decay": weight_decay,
                "adamw_mode": adamw_mode,
                "bias_correction": bias_correction,
            }
        )

    def _hparams(self) -> dict:
        return {
            **self._moment_hparams(),
            "adamw_mode": self.adamw_mode,
            "bias_correction": self.bias_correction,
        }

    def _set_hparams(self, hp: dict) -> None:
        self._set_moment_hparams(hp)
        self.adamw_mode = bool(hp["adamw_mode"])
        self.bias_correction = bool(hp["bias_correction"])

    def _run(self, p, g, states, bits, mode, offset, length, grad_coef) -> None:
        lr, (b1, b2), t = self._step_lr, self.betas, self.step_count
        bc1 = 1.0 - b1**t if self.bias_correction else 1.0
        bc2 = 1.0 - b2**t if self.bias_correction else 1.0
        f = np.float32
        adam_kernel(
            p,
            g,
            states[0],
            states[1],
            bits,
            mode,
            self._nan_bits,
            f(b1),
            f(1.0 - b1),
            f(b2),
            f(1.0 - b2),
            f(self.eps),
            f(self.weight_decay),
            f(1.0 - lr * self.weight_decay),
            self.adamw_mode,
            f(lr / bc1),
            f(math.sqrt(bc2)),
            grad_coef,
        )
