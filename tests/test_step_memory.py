"""The optimizer step's working memory on the device (``plait.fit.plan.STEP_BYTES_PER_ELEMENT``, a row of
``plait estimate-memory``'s plan) against the engine's own step, its allocations counted op by op."""

from __future__ import annotations

import pytest


class _Live:
    """Bytes of the tensors that ops create (storages new to the op's inputs), alive now and at most: a
    ``TorchDispatchMode`` that frees a tensor's bytes when the tensor object goes away."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        import torch
        import weakref

        live = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                known = {t.untyped_storage().data_ptr() for t in leaves}
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if (
                        isinstance(t, torch.Tensor)
                        and t._base is None
                        and t.untyped_storage().data_ptr() not in known
                    ):
                        live.add(t.untyped_storage().nbytes())
                        weakref.finalize(t, live.add, -t.untyped_storage().nbytes())
                return out

        self.now = self.peak = 0
        self.mode = Mode()

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_step_bytes_per_element_are_the_device_steps_temporaries(state_dtype):
    """plait.fit.plan.STEP_BYTES_PER_ELEMENT against the engine's device step (device_states.state_update_),
    measured op by op on the CPU. The CPU takes adam_update_'s square root in float64 (8 bytes, then rounded to
    a float32 4) where CUDA takes it in float32 (4): that phase holds the widened moments (bf16, int8: 8), the
    float32 gradient (4) and 12, so the CPU peak is the larger of the two. int8's requantization alone
    (plait.kernels.quant.quantize_, the moments' 8 besides) holds its scaled values 4 + int64 codes 8 + uint8 1."""
    import torch
    from plait.fit.plan import STEP_BYTES_PER_ELEMENT
    from plait.kernels import CPUAdam
    from plait.kernels.cpu_adam_states import CPUAdamStates
    from plait.kernels.quant import quantize_
    from plait.zero.offload.device_states import state_update_

    n = 256 * 1024
    k = (
        CPUAdam(n, lr=1e-3)
        if state_dtype == "fp32"
        else CPUAdamStates(n, lr=1e-3, state_dtype=state_dtype)
    )
    w, grad = torch.randn(n), torch.randn(n, dtype=torch.bfloat16)
    k.begin_step()
    if state_dtype == "int8":
        tables = k.torch_tables(w.device)  # built once per device and kept (not per step)
    live = _Live()
    with live.mode:
        state_update_(k, w, grad, 0, n, 1.0)
    widened = 0 if state_dtype == "fp32" else 8
    assert live.peak == n * max(STEP_BYTES_PER_ELEMENT[state_dtype], widened + 4 + 8 + 4)
    assert live.now == 0
    if state_dtype == "int8":
        x, live = torch.randn(n), _Live()
        with live.mode:
            quantize_(
                x, k.exp_avg, k.exp_avg_absmax, tables["lengths"], signed=True, mid=tables["smid"]
            )
        per_block = 16 * (
            n // 256
        )  # float32 [blocks] scales: the block maxima, ones_like, where (4 B each)
        assert (
            n * 13 <= live.peak <= n * 13 + per_block and STEP_BYTES_PER_ELEMENT["int8"] == 8 + 13
        )
