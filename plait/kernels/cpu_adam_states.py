"""Adam / AdamW on the host with the moments stored in bf16 or in 8-bit block-wise form (numba).

``CPUAdamStates`` applies :mod:`plait.kernels.cpu_adam`'s update (float32, torch.optim.Adam/AdamW's
folding) on moments read from and written back to their low-precision store in the same pass (formats:
:mod:`plait.kernels.quant`; int8 per Dettmers et al., ICLR 2022, Sec. 2), with fp32 masters and the fused
bf16/fp16 copy-out of ``CPUAdam``. Blocks are independent, so ``step_range`` over whole blocks equals the
whole step; a range must start and end on a block start (``quant.block_starts``). The per-block pass:
``docs/kernels.md``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from plait.kernels.cpu_adam import CPUAdam, _adam_elem
from plait.kernels.lowp import MODE_BF16, MODE_FP16, as_f32, bf16_bits, fp16_bits
from plait.kernels.quant import (
    BLOCK,
    SIGNED_MAP,
    SIGNED_MID,
    SIGNED_START,
    SIGNED_ZERO,
    UNSIGNED_MAP,
    UNSIGNED_MID,
    UNSIGNED_START,
    block_lengths,
    block_starts,
    check_state_dtype,
    dequantize,
    device_tables,
    quantize_,
)

_TABLES = (SIGNED_MAP, SIGNED_MID, SIGNED_START, UNSIGNED_MAP, UNSIGNED_MID, UNSIGNED_START)


@njit(cache=True, inline="always", error_model="numpy")
def _bf16_elem(p, g, m, v, i, hp, nan_bits):
    w, mi, vi = _adam_elem(p[i], as_f32(g[i]), as_f32(m[i]), as_f32(v[i]), hp)
    p[i] = w
    m[i] = bf16_bits(mi, nan_bits)
    v[i] = bf16_bits(vi, nan_bits)
    return w


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def adam_bf16_kernel(p, g, m, v, out, mode, nan_bits, hp):
    """One Adam/AdamW step over float32 ``p`` and bf16 moments ``m, v`` (uint16 bit patterns ``[n]``);
    ``hp`` the float32 scalars of ``_adam_elem``; ``out`` as in ``adam_kernel`` (one loop per mode)."""
    n = p.shape[0]
    if mode == MODE_BF16:
        for i in prange(n):
            out[i] = bf16_bits(_bf16_elem(p, g, m, v, i, hp, nan_bits), nan_bits)
    elif mode == MODE_FP16:
        for i in prange(n):
            out[i] = fp16_bits(_bf16_elem(p, g, m, v, i, hp, nan_bits))
    else:
        for i in prange(n):
            _bf16_elem(p, g, m, v, i, hp, nan_bits)


@njit(cache=True, inline="always", error_model="numpy")
def _code(start, mid, y):
    """Index of the map value nearest float32 ``y``: the count of midpoints below ``y`` (as torch.bucketize),
    from the start table of ``y``'s top 16 bits and one branch-free step (a range of the table holds at most
    one midpoint: ``plait.kernels.quant._start_table``)."""
    idx = np.int64(start[np.float32(y).view(np.uint32) >> np.uint32(16)])
    top = mid.shape[0] - 1
    return idx + (np.int64(idx <= top) & np.int64(mid[min(idx, top)] < y))


@njit(cache=True, inline="always", error_model="numpy")
def _int8_block(p, g, mq, vq, ms, vs, b, lo, hi, out, mode, nan_bits, hp, tables):
    """Block ``b`` (elements ``lo:hi``): dequantize, update, new scales, requantize; separate loops so the
    update and the requantization vectorize."""
    smap, smid, sstart, umap, umid, ustart = tables
    n = hi - lo
    mt = np.empty(n, np.float32)
    vt = np.empty(n, np.float32)
    s_m, s_v = ms[b], vs[b]
    for j in range(n):
        mt[j] = smap[mq[lo + j]] * s_m
        vt[j] = umap[vq[lo + j]] * s_v
    pp, gg = p[lo:hi], g[lo:hi]
    for j in range(n):
        pp[j], mt[j], vt[j] = _adam_elem(pp[j], as_f32(gg[j]), mt[j], vt[j], hp)
    if mode == MODE_BF16:
        for j in range(n):
            out[lo + j] = bf16_bits(pp[j], nan_bits)
    elif mode == MODE_FP16:
        for j in range(n):
            out[lo + j] = fp16_bits(pp[j])
    am, av = np.float32(0.0), np.float32(0.0)
    for j in range(n):
        am, av = max(am, abs(mt[j])), max(av, vt[j])
    ms[b], vs[b] = am, av
    dm = am if am > 0 else np.float32(1.0)
    dv = av if av > 0 else np.float32(1.0)
    for j in range(n):  # one loop per moment: each then vectorizes
        mq[lo + j] = _code(sstart, smid, mt[j] / dm)
    for j in range(n):
        vq[lo + j] = _code(ustart, umid, vt[j] / dv)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def adam_int8_kernel(p, g, mq, vq, ms, vs, starts, b0, b1, out, mode, nan_bits, hp, tables):
    """One Adam/AdamW step over float32 ``p`` and 8-bit moments: uint8 codes ``mq, vq`` and float32 block
    scales ``ms, vs [blocks]``, for blocks ``b0 .. b1-1`` of ``starts`` (element ``starts[b] - starts[b0]``
    of ``p, g, mq, vq, out`` is the first of block ``b``). ``tables``: the signed and unsigned maps, midpoints
    and start tables of ``plait.kernels.quant``."""
    base = starts[b0]
    for b in prange(b0, b1):
        _int8_block(
            p,
            g,
            mq,
            vq,
            ms,
            vs,
            b,
            starts[b] - base,
            starts[b + 1] - base,
            out,
            mode,
            nan_bits,
            hp,
            tables,
        )


class CPUAdamStates(CPUAdam):
    """``CPUAdam`` whose moments are stored in bf16 or 8-bit block-wise form (module docstring).

    Args:
        params, lr, betas, eps, weight_decay, adamw_mode, bias_correction, num_threads: as ``CPUAdam``.
        state_dtype: "bf16" or "int8" (``plait.kernels.quant.STATE_DTYPES``; "fp32" is ``CPUAdam``).
        boundaries: int8: element offsets where a block must start (ZeRO: each segment and parameter piece);
            blocks of at most 256 follow each. Ranges stepped must be unions of whole blocks.

    State: bf16: ``exp_avg``, ``exp_avg_sq`` bfloat16 ``[numel]``. int8: ``exp_avg``, ``exp_avg_sq`` uint8 codes
    ``[numel]``, ``exp_avg_absmax``, ``exp_avg_sq_absmax`` float32 ``[blocks]``. :meth:`state_dict` gives and
    :meth:`load_state_dict` takes the moments as float32 ``[numel]`` under the names of ``CPUAdam``.

    Raises:
        ValueError: an unknown ``state_dtype``; a range that does not start and end on a block start.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        num_threads: int | None = None,
        state_dtype: str = "int8",
        boundaries=(0,),
    ):
        self.state_dtype = check_state_dtype(state_dtype)
        if state_dtype == "fp32":
            raise ValueError("state_dtype='fp32' is plait.kernels.CPUAdam")
        numel = params.numel() if isinstance(params, torch.Tensor) else int(params)
        self.starts = block_starts(numel, boundaries, BLOCK)
        self._torch_tables: dict[str, dict] = {}
        super().__init__(
            params, lr, betas, eps, weight_decay, adamw_mode, bias_correction, num_threads
        )
        if state_dtype == "int8":
            blocks = len(self.starts) - 1
            device = self.exp_avg.device
            self.exp_avg_absmax = torch.zeros(blocks, dtype=torch.float32, device=device)
            self.exp_avg_sq_absmax = torch.zeros(blocks, dtype=torch.float32, device=device)

    def torch_tables(self, device) -> dict[str, torch.Tensor]:
        """``plait.kernels.quant.device_tables`` of this optimizer's blocks on ``device``, made once."""
        key = str(torch.device(device))
        if key not in self._torch_tables:
            self._torch_tables[key] = device_tables(self.starts, device)
        return self._torch_tables[key]

    def _new_state(self, name, numel, device):
        if self.state_dtype == "bf16":
            return torch.zeros(numel, dtype=torch.bfloat16, device=device)
        fill = SIGNED_ZERO if name == "exp_avg" else 0
        return torch.full((numel,), fill, dtype=torch.uint8, device=device)

    def _state_array(self, name):
        t = getattr(self, name)
        return (
            t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
        )

    def _blocks_of(self, offset: int, length: int) -> tuple[int, int]:
        b0, b1 = np.searchsorted(self.starts, [offset, offset + length])
        if self.starts[b0] != offset or self.starts[b1] != offset + length:
            raise ValueError(
                f"range offset={offset}, length={length} does not start and end on a block start of the "
                "8-bit moments; step whole segments (blocks start at each boundary given)"
            )
        return int(b0), int(b1)

    def _check_range(self, offset, length):
        if self.state_dtype == "int8":
            self._blocks_of(offset, length)

    def _run(self, p, g, states, bits, mode, offset, length, grad_coef) -> None:
        hp = self._scalars(grad_coef)
        if self.state_dtype == "bf16":
            adam_bf16_kernel(p, g, states[0], states[1], bits, mode, self._nan_bits, hp)
            return
        b0, b1 = self._blocks_of(offset, length)
        adam_int8_kernel(
            p,
            g,
            states[0],
            states[1],
            self.exp_avg_absmax.numpy(),
            self.exp_avg_sq_absmax.numpy(),
            self.starts,
            b0,
            b1,
            bits,
            mode,
            self._nan_bits,
            hp,
            _TABLES,
        )

    def _scalars(self, grad_coef) -> tuple:
        """The float32 scalars of ``_adam_elem`` for the current step (as ``CPUAdam._run`` passes them)."""
        lr, (b1, b2), t = self._step_lr, self.betas, self.step_count
        bc1 = 1.0 - b1**t if self.bias_correction else 1.0
        bc2 = 1.0 - b2**t if self.bias_correction else 1.0
        f = np.float32
        return (
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
            f(grad_coef),
        )

    # ---- the moments as float32 (checkpoints, conversion between state dtypes) ------------------------------
    def moment(self, name: str) -> torch.Tensor:
        """float32 ``[numel]`` values of moment ``name`` ("exp_avg" or "exp_avg_sq"), a new tensor."""
        if self.state_dtype == "bf16":
            return getattr(self, name).float()
        lengths = block_lengths(self.starts, getattr(self, name).device)
        return dequantize(
            getattr(self, name), getattr(self, name + "_absmax"), lengths, name == "exp_avg"
        )

    def set_moment(self, name: str, values: torch.Tensor) -> None:
        """Store float32 ``values [numel]`` as moment ``name`` (rounded / quantized to this state dtype)."""
        values = values.reshape(-1).to(torch.float32)
        if values.numel() != self.numel:
            raise ValueError(
                f"state '{name}' has {values.numel()} elements but this optimizer has numel={self.numel}"
            )
        if self.state_dtype == "bf16":
            getattr(self, name).copy_(values)
            return
        store = getattr(self, name)
        quantize_(
            values.to(store.device),
            store,
            getattr(self, name + "_absmax"),
            block_lengths(self.starts, store.device),
            name == "exp_avg",
        )

    def state_dict(self) -> dict:
        """As ``CPUAdam.state_dict``, with the moments as float32 values (copies) and ``state_dtype``."""
        sd = {"step": self.step_count, "hparams": self._hparams(), "state_dtype": self.state_dtype}
        sd.update({n: self.moment(n) for n in self._state_names})
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Load float32 moments (any state dtype's ``state_dict``, or ``CPUAdam``'s) into this state dtype."""
        for n in self._state_names:
            if n not in sd:
                raise KeyError(f"state dict has no '{n}' (keys: {sorted(sd)})")
            self.set_moment(n, sd[n])
        self.step_count = int(sd["step"])
        self._step_lr = None
        if "hparams" in sd:
            self._set_hparams(sd["hparams"])
