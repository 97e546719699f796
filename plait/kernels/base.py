"""What every flat-buffer CPU optimizer shares: buffer checks, threads, the step counter, ranges, state.

``FlatOptimizer`` turns a rank's flat float32 host buffers (masters, gradients, states of ``numel``
elements) into zero-copy numpy views, checks lengths and keeps the step count; subclasses supply the
numba kernel. One step may run bucket by bucket, bit-identical to ``step`` (elementwise updates)::

    opt.begin_step(lr)                      # step counter += 1, lr fixed for this step
    for off, n, grad_bucket in buckets:     # any order, each range exactly once
        opt.step_range(params, grad_bucket, off, n, lowp_out=params_bf16)

``with numba_threads(n):`` sets numba's thread count for its body only (per calling thread).
Concurrent calls from several Python threads need numba's ``omp`` or ``tbb`` layer. Kernels use no
``fastmath`` and ``error_model="numpy"``, so results do not depend on the thread count. More: ``docs/kernels.md``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import numba
import numpy as np
import torch

from plait.kernels.host_memory import keep_from_children
from plait.kernels.lowp import (
    MODE_NONE,
    flat_f32,
    grad_view,
    lowp_bits_view,
    torch_bf16_nan_bits,
)


@contextmanager
def numba_threads(n: int):
    """Run the body with numba's thread count set to ``n``, restoring the caller's count after.

    ``numba.set_num_threads`` is per calling thread, so this affects nothing outside the block.
    """
    prev = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(prev)


def _check_beta(name: str, b: float) -> float:
    if not 0.0 <= b < 1.0:
        raise ValueError(f"{name}={b} must be in [0, 1)")
    return float(b)


class FlatOptimizer:
    """Base class: a step counter and fp32 state tensors over ``numel`` elements.

    Args:
        params: the flat float32 master buffer (only its element count is used) or that count.
        lr: learning rate (units of the parameter per step).
        num_threads: numba threads per call; None -> all (``numba.config.NUMBA_NUM_THREADS``).

    Subclasses set ``_state_names`` and implement ``_run`` and ``_hparams``/``_set_hparams``.
    """

    _state_names: tuple[str, ...] = ()

    def __init__(self, params, lr: float, num_threads: int | None = None):
        numel = (
            params.numel()
            if isinstance(params, torch.Tensor)
            else int(getattr(params, "size", params))
        )
        if numel < 0:
            raise ValueError(f"numel={numel} must be >= 0")
        if lr < 0:
            raise ValueError(f"lr={lr} must be >= 0")
        max_threads = numba.config.NUMBA_NUM_THREADS
        if num_threads is None:
            num_threads = max_threads
        if not 1 <= num_threads <= max_threads:
            raise ValueError(
                f"num_threads={num_threads} must be in [1, {max_threads}]; numba's pool size is fixed at "
                "start-up by NUMBA_NUM_THREADS"
            )
        self.numel = numel
        self.lr = float(lr)
        self.num_threads = int(num_threads)
        self.step_count = 0
        self._step_lr: float | None = None
        self._nan_bits = np.uint16(torch_bf16_nan_bits())
        # states beside the parameters: host memory, or device memory for a master that ZeRO-Offload's
        # placement keeps on the device (stepped there by ``plait.zero.offload.device_share``, never by _run)
        device = params.device if isinstance(params, torch.Tensor) else torch.device("cpu")
        for name in self._state_names:
            setattr(self, name, keep_from_children(self._new_state(name, numel, device)))

    # ---- stepping -------------------------------------------------------------------------------
    def begin_step(self, lr: float | None = None) -> int:
        """Start one optimizer step: advance the step counter (bias correction uses it) and fix lr.

        Call once per optimizer step, then :meth:`step_range` once for each range of the buffer.
        Returns the new step count (1 for the first step).
        """
        self.step_count += 1
        self._step_lr = self.lr if lr is None else float(lr)
        if self._step_lr < 0:
            raise ValueError(f"lr={self._step_lr} must be >= 0")
        return self.step_count

    def step_range(
        self,
        params,
        grads,
        offset: int = 0,
        length: int | None = None,
        lowp_out=None,
        grad_coef: float = 1.0,
    ) -> None:
        """Update elements ``[offset, offset + length)`` of the flat buffer for the current step.

        Args:
            params: float32 master weights, ``[numel]`` (whole buffer; the range is sliced out) or
                ``[length]`` (just the range). Updated in place.
            grads: float32 or bfloat16 gradients, ``[numel]`` or ``[length]`` likewise. Read only.
                bf16 is read as is (2 bytes/element instead of 4) and widened exactly in the kernel,
                so the result equals passing ``grads.float()``.
            offset: first element of the range. length: its size (None: to the end).
            lowp_out: None, or a bf16/fp16 tensor (or numpy float16 array) ``[numel]`` or ``[length]``
                that receives the updated weights rounded to nearest even, in the same pass.
            grad_coef: the gradient is multiplied by it (in float32, as ``grad.mul_(coef)`` in torch): the
                gradient-clipping coefficient divided by the fp16 loss scale; must be finite and > 0.

        Raises:
            RuntimeError: :meth:`begin_step` was not called first.
            ValueError: range outside ``[0, numel]``, buffers of another size, bad ``grad_coef``.
        """
        if self._step_lr is None:
            raise RuntimeError(
                "call begin_step() before step_range(): it advances the step counter once per step"
            )
        if length is None:
            length = self.numel - offset
        if offset < 0 or length < 0 or offset + length > self.numel:
            raise ValueError(
                f"range offset={offset}, length={length} lies outside the buffer of numel={self.numel}"
            )
        if not (math.isfinite(grad_coef) and grad_coef > 0):
            raise ValueError(
                f"grad_coef={grad_coef} must be finite and > 0 (it multiplies the gradient)"
            )
        self._check_range(offset, length)
        p = self._slice(flat_f32(params, "params"), offset, length, "params")
        g = self._slice(grad_view(grads, "grads"), offset, length, "grads")
        bits, mode = lowp_bits_view(lowp_out)
        if mode != MODE_NONE:
            bits = self._slice(bits, offset, length, "lowp_out")
        states = [self._state_array(n)[offset : offset + length] for n in self._state_names]
        if length == 0:
            return
        with numba_threads(self.num_threads):
            self._run(p, g, states, bits, mode, offset, length, np.float32(grad_coef))

    def step(
        self, params, grads, lowp_out=None, lr: float | None = None, grad_coef: float = 1.0
    ) -> None:
        """One whole optimizer step over the buffer: ``begin_step(lr)`` then ``step_range`` of all of it.

        Shapes as in :meth:`step_range` with ``length == numel``.
        """
        self.begin_step(lr)
        self.step_range(params, grads, 0, self.numel, lowp_out=lowp_out, grad_coef=grad_coef)

    def _slice(self, arr: np.ndarray, offset: int, length: int, name: str) -> np.ndarray:
        if arr.shape[0] == self.numel:
            return arr[offset : offset + length]
        if arr.shape[0] == length:
            return arr
        raise ValueError(
            f"{name} has {arr.shape[0]} elements; expected the whole buffer ({self.numel}) or the range ({length})"
        )

    def _new_state(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """Hook: a zero state tensor ``[numel]`` (float32 here; a subclass may store states in less)."""
        return torch.zeros(numel, dtype=torch.float32, device=device)

    def _state_array(self, name: str) -> np.ndarray:
        """Hook: the numpy view the kernel steps of state ``name`` (``[numel]``)."""
        return getattr(self, name).numpy()

    def _check_range(self, offset: int, length: int) -> None:
        """Hook: a subclass whose update couples elements restricts the allowed ranges here."""

    def _run(self, p, g, states, bits, mode, offset, length, grad_coef) -> None:
        raise NotImplementedError

    # ---- checkpoints ----------------------------------------------------------------------------
    def _hparams(self) -> dict:
        return {"lr": self.lr}

    def _set_hparams(self, hp: dict) -> None:
        self.lr = float(hp["lr"])

    def _moment_hparams(self) -> dict:
        """lr, betas, weight decay and (Adam) eps: what every moment-based optimizer here saves."""
        out = {
            "lr": self.lr,
            "beta1": self.betas[0],
            "beta2": self.betas[1],
            "weight_decay": self.weight_decay,
        }
        if hasattr(self, "eps"):
            out["eps"] = self.eps
        return out

    def _set_moment_hparams(self, hp: dict) -> None:
        """Check and set the fields of ``_moment_hparams``.

        Raises:
            ValueError: a negative eps or weight decay, or a beta outside [0, 1).
        """
        if hp["weight_decay"] < 0 or hp.get("eps", 0.0) < 0:
            raise ValueError(
                f"eps={hp.get('eps')} and weight_decay={hp['weight_decay']} must be >= 0"
            )
        self.lr = float(hp["lr"])
        self.betas = (_check_beta("beta1", hp["beta1"]), _check_beta("beta2", hp["beta2"]))
        self.weight_decay = float(hp["weight_decay"])
        if "eps" in hp:
            self.eps = float(hp["eps"])

    def state_dict(self) -> dict:
        """Plain tensors and numbers: ``{"step": int, "hparams": {name: float|bool}, <state name>: [numel] fp32}``.

        The tensors are the live state (no copy); save or clone them before the next step.
        """
        sd = {"step": self.step_count, "hparams": self._hparams()}
        for n in self._state_names:
            sd[n] = getattr(self, n)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Copy state from :meth:`state_dict` output (in place, so views of the state stay valid).

        Raises:
            KeyError: a state tensor is missing. ValueError: a tensor has another element count.
        """
        for n in self._state_names:
            if n not in sd:
                raise KeyError(
                    f"state dict has no '{n}' (keys: {sorted(sd)}); was it saved by {type(self).__name__}?"
                )
            t = sd[n]
            if t.numel() != self.numel:
                raise ValueError(
                    f"state '{n}' has {t.numel()} elements but this optimizer has numel={self.numel}; "
                    "load the partition saved for this rank's layout"
                )
        for n in self._state_names:
            getattr(self, n).copy_(sd[n].reshape(-1).to(torch.float32))
        self.step_count = int(sd["step"])
        self._step_lr = None
        if "hparams" in sd:
            self._set_hparams(sd["hparams"])
