"""Adam moments in bf16 and 8-bit blocks (plait.kernels.quant, cpu_adam_states, zero.offload.device_states):
the maps and block quantization against a float64 reference with the bound derived from the map's spacing and
the block's absmax, the fused numba step against a float64 Adam step, torch ops == numba bit for bit, bf16
moments against fp32 moments over N steps within a derived bound, and the bytes per parameter."""

import numpy as np
import pytest
import torch

from plait.kernels import CPUAdam
from plait.kernels.cpu_adam_states import CPUAdamStates
from plait.kernels.quant import (
    SIGNED_MAP,
    UNSIGNED_MAP,
    block_lengths,
    block_starts,
    dequantize,
    quantize_,
    state_nbytes,
)
from plait.zero.offload.device_states import state_update_

EPS32 = 2.0**-24  # float32 unit roundoff


def _blocky(n, starts, signed, seed=0):
    """float32 values whose blocks span 8 decades of scale (as Adam moments do across parameters)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    x = x if signed else x.abs() ** 2
    scales = 10.0 ** (torch.rand(len(starts) - 1, generator=gen, dtype=torch.float64) * 8 - 6)
    return (x * torch.repeat_interleave(scales, torch.from_numpy(np.diff(starts)))).float()


def _map_bound(x64, scale64, signed):
    """Per element: half the gap between the two map values around ``x / s`` times ``s`` (nearest value),
    plus float32 rounding of ``x / s`` and of ``code * s`` (4 ulp of ``s``)."""
    table = np.asarray(SIGNED_MAP if signed else UNSIGNED_MAP, dtype=np.float64)
    y = np.clip(x64 / scale64, table[0], table[-1])
    hi = np.clip(np.searchsorted(table, y, side="left"), 1, len(table) - 1)
    gap = table[hi] - table[hi - 1]
    return scale64 * (gap / 2 + 4 * EPS32)


def _expand(per_block, starts):
    return np.repeat(per_block, np.diff(starts))


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_dequantize_within_the_map_bound_and_broken_variants_fail(signed):
    n = 256 * 12 + 77
    starts = block_starts(n, [0, 300, 301, 1000])  # irregular blocks: boundaries cut some short
    lengths = block_lengths(starts, "cpu")
    x = _blocky(n, starts, signed)
    codes, absmax = torch.empty(n, dtype=torch.uint8), torch.empty(len(lengths))
    quantize_(x, codes, absmax, lengths, signed)
    x64 = x.double().numpy()
    scale = np.maximum.reduceat(np.abs(x64), starts[:-1])
    assert np.array_equal(
        absmax.double().numpy(), scale
    )  # the scale is the block's absmax, exactly
    bound = _map_bound(x64, _expand(scale, starts), signed)
    err = np.abs(dequantize(codes, absmax, lengths, signed).double().numpy() - x64)
    assert (err <= bound).all(), float((err / bound).max())
    assert (err / bound).max() > 0.45  # the bound is tight: nearest value, half a gap
    # broken: blocks of 512 (one absmax over two blocks of different scales): the smaller block loses precision
    wide = block_lengths(block_starts(n, [0], 512), "cpu")
    c512, a512 = torch.empty_like(codes), torch.empty(len(wide))
    quantize_(x, c512, a512, wide, signed)
    bad = dequantize(c512, a512, wide, signed).double().numpy()
    assert (np.abs(bad - x64) > bound).mean() > 0.2
    # broken: the scale left out (values read back in [-1, 1])
    bad = dequantize(codes, torch.ones_like(absmax), lengths, signed).double().numpy()
    assert (np.abs(bad - x64) > bound).mean() > 0.9


def test_requantizing_dequantized_values_gives_the_same_codes():
    n = 256 * 5
    starts = block_starts(n)
    lengths = block_lengths(starts, "cpu")
    x = _blocky(n, starts, True, seed=3)
    c1, a1 = torch.empty(n, dtype=torch.uint8), torch.empty(5)
    quantize_(x, c1, a1, lengths, True)
    c2, a2 = torch.empty_like(c1), torch.empty_like(a1)
    quantize_(dequantize(c1, a1, lengths, True), c2, a2, lengths, True)
    assert torch.equal(c1, c2) and torch.equal(a1, a2)


def _adam64(w, g, m, v, t, lr, b1, b2, eps, wd):
    """float64 AdamW step (Loshchilov & Hutter 2019, Alg. 2; torch.optim.AdamW)."""
    w = w * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    upd = lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
    return w - upd, m, v, upd


def test_fused_int8_step_matches_a_float64_reference():
    n, hp = 256 * 16 + 40, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt = CPUAdamStates(n, **hp, state_dtype="int8", boundaries=[0, 1000])
    starts = opt.starts
    gen = torch.Generator().manual_seed(1)
    opt.set_moment("exp_avg", _blocky(n, starts, True, seed=5) * 1e-2)
    opt.set_moment("exp_avg_sq", _blocky(n, starts, False, seed=6) * 1e-4)
    opt.step_count = 6
    m0, v0 = opt.moment("exp_avg").double().numpy(), opt.moment("exp_avg_sq").double().numpy()
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    w64, g64 = w.double().numpy(), g.double().numpy()
    opt.step(w, g)
    w_ref, m_ref, v_ref, upd = _adam64(
        w64, g64, m0, v0, 7, hp["lr"], *hp["betas"], hp["eps"], hp["weight_decay"]
    )
    # weights: float32 roundings of the decay factor, the decayed weight and the subtraction (3u |w|) and of
    # the update's handful of operations (16u |update|)
    assert (
        np.abs(w.double().numpy() - w_ref) <= 3 * EPS32 * np.abs(w_ref) + 16 * EPS32 * np.abs(upd)
    ).all()
    # moments: the new scale is the block's new absmax, and each value is within the map bound of the exact one
    for name, ref, signed in (("exp_avg", m_ref, True), ("exp_avg_sq", v_ref, False)):
        scale = np.maximum.reduceat(np.abs(ref), starts[:-1])
        got = getattr(opt, name + "_absmax").double().numpy()
        assert np.allclose(got, scale, rtol=8 * EPS32, atol=0)
        bound = _map_bound(ref, _expand(scale, starts), signed) + 8 * EPS32 * np.abs(ref)
        assert (np.abs(opt.moment(name).double().numpy() - ref) <= bound).all()


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_torch_ops_equal_the_numba_kernel_bit_for_bit(state_dtype):
    n, bounds = 256 * 6 + 13, [0, 500, 700]
    kw = dict(lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, boundaries=bounds)
    host, dev = CPUAdamStates(n, **kw), CPUAdamStates(n, **kw)
    gen = torch.Generator().manual_seed(2)
    w_host = torch.randn(n, generator=gen)
    w_dev = w_host.clone()
    for _ in range(3):
        g = torch.randn(n, generator=gen)
        host.step(w_host, g, grad_coef=0.5)
        dev.begin_step()
        for lo, hi in zip([0, 500, 700], [500, 700, n]):  # by segment, as the stepper does
            state_update_(dev, w_dev[lo:hi], g[lo:hi], lo, hi - lo, 0.5)
    assert torch.equal(w_host, w_dev)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(host, name), getattr(dev, name))
        if state_dtype == "int8":
            assert torch.equal(getattr(host, name + "_absmax"), getattr(dev, name + "_absmax"))
    if state_dtype == "int8":
        with pytest.raises(ValueError, match="block start"):
            host.begin_step()
            host.step_range(w_host, g, 10, 100)


def test_bf16_moments_stay_within_the_derived_bound_of_fp32_moments():
    """Storing a moment in bf16 (8 significant bits) rounds the value ``beta1 m~_{t-1} + (1 - beta1) g`` = m_t +
    beta1 e_{t-1} by at most u = 2^-8 of it, and the recursion carries earlier errors with factor beta:
    |m_bf16_t - m_t| <= B_t, B_t = beta1 (1 + u) B_{t-1} + u |m_t| (same for v with beta2); the float32
    arithmetic adds far less (2^-24 relative, the 1.01). The weights then differ by at most the sum over
    steps of lr * (dm / bc1) / (sqrt(v_hat) + eps) + lr * |m_hat| * dv_hat / (2 sqrt(v_hat) (sqrt(v_hat)+eps)^2)
    to first order (x1.1 for second-order terms)."""
    n, steps, lr, b1, b2, eps, u = 4096, 20, 1e-3, 0.9, 0.999, 1e-8, 2.0**-8
    lo, hi = CPUAdamStates(n, lr=lr, state_dtype="bf16"), CPUAdam(n, lr=lr)
    gen = torch.Generator().manual_seed(4)
    w_lo = torch.randn(n, generator=gen)
    w_hi = w_lo.clone()
    bm, bv, bw = np.zeros(n), np.zeros(n), np.zeros(n)
    for t in range(1, steps + 1):
        g = torch.randn(n, generator=gen) * 1e-2 + 3e-3
        lo.step(w_lo, g)
        hi.step(w_hi, g)
        m, v = hi.exp_avg.double().numpy(), hi.exp_avg_sq.double().numpy()
        bm, bv = b1 * (1 + u) * bm + u * np.abs(m) * 1.01, b2 * (1 + u) * bv + u * v * 1.01
        vh, mh = np.sqrt(v / (1 - b2**t)), m / (1 - b1**t)
        bw += (
            1.1
            * lr
            * (
                bm / (1 - b1**t) / (vh + eps)
                + np.abs(mh) * (bv / (1 - b2**t)) / (2 * vh * (vh + eps) ** 2)
            )
        )
        assert (np.abs(lo.moment("exp_avg").double().numpy() - m) <= bm).all()
        assert (np.abs(lo.moment("exp_avg_sq").double().numpy() - v) <= bv).all()
    dw = np.abs(w_lo.double().numpy() - w_hi.double().numpy())
    assert (dw <= bw + 4 * EPS32 * np.abs(w_hi.double().numpy())).all()
    # not a vacuous bound: the worst moment error reaches a good part of it (0.40 measured), the weights 0.20
    assert (np.abs(lo.moment("exp_avg").double().numpy() - m) / bm).max() > 0.25
    assert (dw / bw).max() > 0.1


def test_state_bytes_per_parameter():
    n = 1 << 16
    measured = {}
    for dtype in ("fp32", "bf16", "int8"):
        k = CPUAdam(n) if dtype == "fp32" else CPUAdamStates(n, state_dtype=dtype)
        tensors = [
            getattr(k, a)
            for a in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")
            if hasattr(k, a)
        ]
        measured[dtype] = sum(t.numel() * t.element_size() for t in tensors) / n
        assert measured[dtype] * n == state_nbytes(n, dtype)
    assert measured == {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 8 / 256}


@pytest.mark.parametrize("signed", [True, False])
def test_the_kernels_code_search_equals_bucketize_on_every_range(signed):
    """``_code`` (a start table over the top 16 bits, then one step) picks what torch.bucketize picks: for the
    midpoints themselves (ties go to the lower value), their float32 neighbours, 0, the ends, and values spread
    over every exponent."""
    from numba import njit
    from plait.kernels.cpu_adam_states import _code
    from plait.kernels.quant import SIGNED_MID, SIGNED_START, UNSIGNED_MID, UNSIGNED_START

    mid, start = (SIGNED_MID, SIGNED_START) if signed else (UNSIGNED_MID, UNSIGNED_START)

    @njit
    def codes(ys):
        return np.array([_code(start, mid, y) for y in ys])

    gen = np.random.default_rng(0)
    spread = (gen.random(20000) * 10.0 ** gen.uniform(-9, 0, 20000)).astype(np.float32)
    ys = np.concatenate(
        [
            mid,
            np.nextafter(mid, np.float32(2)),
            np.nextafter(mid, np.float32(-2)),
            [0, 1],
            spread,
            -spread if signed else spread,
            [-1] if signed else [],
        ]
    ).astype(np.float32)
    want = torch.bucketize(torch.from_numpy(ys), torch.from_numpy(mid)).numpy()
    assert np.array_equal(codes(ys), want)


def test_host_optimizer_state_dict_round_trip_keeps_int8_moments():
    """torch's API on the offload optimizer: its state dict holds float32 moment values, and loading it into a
    fresh int8 optimizer requantizes them to the same codes and scales."""
    from plait.zero.offload import HostOptimizer

    w = torch.randn(600)
    a = HostOptimizer([w], kind="adamw", lr=1e-2, state_dtype="int8", boundaries={w: [0, 300]})
    for _ in range(2):
        w.grad = torch.randn(600)
        a.step()
    sd = a.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    w2 = w.detach().clone()
    b = HostOptimizer([w2], kind="adamw", lr=1e-2, state_dtype="int8", boundaries={w2: [0, 300]})
    b.load_state_dict(sd)
    for name in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
        assert torch.equal(a.state[w][name], b.state[w2][name]), name
