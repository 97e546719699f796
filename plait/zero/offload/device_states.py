"""Adam/AdamW in torch ops on moments stored as fp32, bf16 or 8-bit blocks: the device side of the host kernels.

A master the placement keeps in device memory (``offload.placement``), and a non-offloaded ZeRO shard
whose moments are stored in less than fp32 (``optimizer.params.state_dtype``), are stepped here with the
moment store of their ``CPUAdam`` / ``CPUAdamStates`` (``plait.kernels``): the moments are widened or
dequantized (``plait.kernels.quant``: the same maps and block layout as the numba kernels), updated by
``device_share.adam_update_`` (the numba kernel's float32 roundings) and rounded or requantized back, so on
the CPU the result is bit-identical to the numba kernels' (``tests/test_quant_states.py``). Vectorized
over blocks; temporaries of about 12 bytes per element of the range.
"""

from __future__ import annotations

import torch

from plait.kernels.quant import dequantize, quantize_
from plait.zero.offload.device_share import adam_update_


def state_update_(
    k, w: torch.Tensor, grad: torch.Tensor, lo: int, n: int, grad_coef: float
) -> None:
    """One Adam/AdamW step of elements ``[lo, lo+n)``: master ``w`` (float32 ``[n]``, updated in place) from
    ``grad`` (``[n]``), with the moments, hyper-parameters, lr and step count of ``k``.

    Raises:
        ValueError: int8 moments and a range that is not a union of whole blocks.
    """
    dtype = getattr(k, "state_dtype", "fp32")
    if dtype == "fp32":
        adam_update_(w, grad, k.exp_avg[lo : lo + n], k.exp_avg_sq[lo : lo + n], k, grad_coef)
        return
    m_store, v_store = k.exp_avg[lo : lo + n], k.exp_avg_sq[lo : lo + n]
    if dtype == "bf16":
        m, v = m_store.float(), v_store.float()
        adam_update_(w, grad, m, v, k, grad_coef)
        m_store.copy_(m)  # round to nearest even, as the kernel's bf16_bits
        v_store.copy_(v)
        return
    b0, b1 = k._blocks_of(lo, n)
    t = k.torch_tables(w.device)
    lengths = t["lengths"][b0:b1]
    m_scale, v_scale = k.exp_avg_absmax[b0:b1], k.exp_avg_sq_absmax[b0:b1]
    m = dequantize(m_store, m_scale, lengths, signed=True, table=t["smap"])
    v = dequantize(v_store, v_scale, lengths, signed=False, table=t["umap"])
    adam_update_(w, grad, m, v, k, grad_coef)
    quantize_(m, m_store, m_scale, lengths, signed=True, mid=t["smid"])
    quantize_(v, v_store, v_scale, lengths, signed=False, mid=t["umid"])
