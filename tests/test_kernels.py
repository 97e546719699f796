"""plait.kernels: numba CPU optimizers against torch / reference formulas, and bit-exact copy-out.

Tolerance: "relative" below is max|ours - ref| / max|ref| per tensor, required <= 1e-6 after 10
steps (float32 rounding differs only by operation order, e.g. torch's FMA in lerp/add).
"""

import itertools

import numba
import numpy as np
import pytest
import torch

from plait.kernels import CPUAdam, CPULion, compile_kernels, copy_to_lowp
from plait.kernels.lowp import sum_of_squares
from helpers import rel_err

STEPS = 10
RTOL = 1e-6
# Several parameter tensors in one flat buffer, including an empty one and a single element.
SEGMENTS = [0, 700, 700, 701, 2000, 2150, 3333]
N = SEGMENTS[-1]


def data(seed: int, steps: int = STEPS):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(N, generator=gen)
    p[SEGMENTS[4] : SEGMENTS[5]] = 0.0  # an all-zero tensor
    grads = [torch.randn(N, generator=gen) * (0.5 + k) for k in range(steps)]
    return p, grads


def bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


# ---- reference formulas (torch float32) ------------------------------------------------------------
def ref_adam_nobc(p, grads, lr, b1, b2, eps, wd, adamw):
    p, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    for g in grads:
        if adamw:
            p = p * (1 - lr * wd)
        elif wd:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (v.sqrt() + eps))
    return p, m, v


def ref_lion(p, grads, lr, b1, b2, wd):
    p, m = p.clone(), torch.zeros_like(p)
    for g in grads:
        c = b1 * m + (1 - b1) * g
        p = p - lr * (torch.sign(c) + wd * p)
        m = b2 * m + (1 - b2) * g
    return p, m


# ---- optimizers vs references ------------------------------------------------------------------------
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_matches_torch(adamw, wd):
    p0, grads = data(1)
    ref = p0.clone().requires_grad_()
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    topt = cls([ref], lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd, foreach=False)
    p = p0.clone()
    opt = CPUAdam(p, lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd, adamw_mode=adamw)
    for g in grads:
        ref.grad = g.clone()
        topt.step()
        opt.step(p, g)
    st = topt.state[ref]
    assert opt.step_count == STEPS
    assert rel_err(p, ref.detach(), norm="max") <= RTOL
    assert rel_err(opt.exp_avg, st["exp_avg"], norm="max") <= RTOL
    assert rel_err(opt.exp_avg_sq, st["exp_avg_sq"], norm="max") <= RTOL


@pytest.mark.parametrize("adamw,wd", [(True, 0.1), (False, 0.1), (True, 0.0)])
def test_adam_without_bias_correction(adamw, wd):
    p0, grads = data(2)
    p = p0.clone()
    opt = CPUAdam(
        N,
        lr=1e-3,
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=wd,
        adamw_mode=adamw,
        bias_correction=False,
    )
    for g in grads:
        opt.step(p, g)
    rp, rm, rv = ref_adam_nobc(p0, grads, 1e-3, 0.8, 0.95, 1e-6, wd, adamw)
    assert rel_err(p, rp, norm="max") <= RTOL
    assert rel_err(opt.exp_avg, rm, norm="max") <= RTOL
    assert rel_err(opt.exp_avg_sq, rv, norm="max") <= RTOL


@pytest.mark.parametrize("wd", [0.0, 0.3])
def test_lion_matches_reference(wd):
    p0, grads = data(3)
    p = p0.clone()
    opt = CPULion(p, lr=3e-4, betas=(0.9, 0.99), weight_decay=wd)
    for g in grads:
        opt.step(p, g)
    rp, rm = ref_lion(p0, grads, 3e-4, 0.9, 0.99, wd)
    assert rel_err(p, rp, norm="max") <= RTOL
    assert rel_err(opt.exp_avg, rm, norm="max") <= RTOL


# ---- stepping by bucket, threads, grad_coef, checkpoints ----------------------------------------------
def make_all():
    return [
        CPUAdam(N, lr=1e-3, weight_decay=0.1),
        CPUAdam(N, lr=1e-3, weight_decay=0.1, adamw_mode=False),
        CPULion(N, lr=1e-4, weight_decay=0.1),
    ]


@pytest.mark.parametrize("k", range(3))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_step_by_bucket_equals_whole_step(k, dtype):
    p0, grads = data(5, steps=3)
    whole, bucketed = make_all()[k], make_all()[k]
    pw, pb = p0.clone(), p0.clone()
    ow, ob = torch.empty(N, dtype=dtype), torch.empty(N, dtype=dtype)
    cuts = [0, 1, 999, 1000, 2500, N]  # arbitrary cuts: the optimizers are element-wise
    ranges = list(itertools.pairwise(cuts))[::-1]  # buckets arrive last layer first
    for g in grads:
        whole.step(pw, g, ow)
        assert bucketed.begin_step() == whole.step_count
        for a, b in ranges:
            # params/lowp as the whole buffer, the gradient as a bucket-sized tensor of its own
            bucketed.step_range(pb, g[a:b].clone(), a, b - a, lowp_out=ob)
    assert torch.equal(pw, pb) and torch.equal(ow.view(torch.int16), ob.view(torch.int16))
    for name in whole._state_names:
        assert torch.equal(getattr(whole, name), getattr(bucketed, name))


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
@pytest.mark.parametrize("k", range(3))
def test_thread_count_does_not_change_results_or_leak(k):
    p0, grads = data(6, steps=2)
    outs = []
    before = numba.get_num_threads()
    for threads in (1, 2):
        opt = make_all()[k]
        opt.num_threads = threads
        p = p0.clone()
        for g in grads:
            opt.step(p, g)
        outs.append(p)
        assert numba.get_num_threads() == before
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("k", range(3))
def test_grad_coef_multiplies_the_gradient(k):
    p0, grads = data(7, steps=3)
    a, b, c, d, e = (make_all()[k] for _ in range(5))
    pa, pb, pc, pd, pe = (p0.clone() for _ in range(5))
    for g in grads:
        a.step(pa, g)
        b.step(pb, g * 1024.0, grad_coef=1 / 1024.0)  # power of two: exact
        c.step(pc, g * 3.7, grad_coef=1 / 3.7)  # rounding only
        d.step(pd, g, grad_coef=0.37)  # what ZeroOptimizer does without offload: g.mul_(coef)
        e.step(pe, g.mul(0.37))
    assert torch.equal(pa, pb)
    assert rel_err(pc, pa, norm="max") <= RTOL
    assert torch.equal(pd, pe)


@pytest.mark.parametrize("k", range(3))
def test_bf16_gradients_equal_their_float32_widening(k):
    """bf16 gradients are read as they are (2 bytes/element) and widened exactly in the kernel: bit-equal
    to stepping with ``grad.float()``, in every copy-out mode (inf/nan gradients included)."""
    p0, grads = data(9, steps=3)
    grads = [g.to(torch.bfloat16) for g in grads]
    grads[1][7], grads[1][8] = float("inf"), float("nan")
    for out_dtype in (None, torch.bfloat16, torch.float16):
        a, b = make_all()[k], make_all()[k]
        pa, pb = p0.clone(), p0.clone()
        oa, ob = (
            (torch.empty(N, dtype=out_dtype), torch.empty(N, dtype=out_dtype))
            if out_dtype
            else (None, None)
        )
        for g in grads:
            a.step(pa, g.float(), oa)
            b.step(pb, g, ob)
        assert torch.equal(pa.view(torch.int32), pb.view(torch.int32))
        if out_dtype is not None:
            assert torch.equal(oa.view(torch.int16), ob.view(torch.int16))
        for name in a._state_names:
            assert torch.equal(
                getattr(a, name).view(torch.int32), getattr(b, name).view(torch.int32)
            )


def test_sum_of_squares_float32_and_bf16():
    g = torch.randn(100_003, generator=torch.Generator().manual_seed(3))
    want = float((g.double() ** 2).sum())
    assert abs(sum_of_squares(g) - want) <= 1e-12 * want
    h = g.to(torch.bfloat16)
    want_h = float((h.double() ** 2).sum())
    assert abs(sum_of_squares(h) - want_h) <= 1e-12 * want_h
    h[5] = float("inf")
    assert sum_of_squares(h) == float("inf")
    h[6] = float("nan")
    assert np.isnan(sum_of_squares(h))
    with pytest.raises(TypeError, match="float16"):
        sum_of_squares(g.half())
    with pytest.raises(ValueError, match="contiguous"):
        sum_of_squares(g[::2])


@pytest.mark.parametrize("k", range(3))
def test_state_dict_round_trip_resumes_exactly(k):
    p0, grads = data(8, steps=5)
    full, first = make_all()[k], make_all()[k]
    pf, pr = p0.clone(), p0.clone()
    for g in grads:
        full.step(pf, g)
    for g in grads[:3]:
        first.step(pr, g)
    sd = {
        key: (val.clone() if isinstance(val, torch.Tensor) else val)
        for key, val in first.state_dict().items()
    }
    assert all(isinstance(v, (int, float, bool)) for v in sd["hparams"].values())
    resumed = make_all()[k]
    resumed.lr = 123.0  # overwritten by the saved hyperparameters
    resumed.load_state_dict(sd)
    assert resumed.step_count == 3 and resumed.lr == first.lr
    for g in grads[3:]:
        resumed.step(pr, g)
    assert torch.equal(pf, pr)


def test_lr_override_and_errors():
    p0, grads = data(9, steps=1)
    a, b = CPUAdam(N, lr=1e-3), CPUAdam(N, lr=5e-3)
    pa, pb = p0.clone(), p0.clone()
    a.step(pa, grads[0], lr=5e-3)
    b.step(pb, grads[0])
    assert torch.equal(pa, pb) and a.lr == 1e-3

    fresh = CPUAdam(N)
    with pytest.raises(RuntimeError, match="begin_step"):
        fresh.step_range(p0, grads[0], 0, 10)
    fresh.begin_step()
    with pytest.raises(ValueError, match="numel=3333"):
        fresh.step_range(p0, grads[0], 3000, 500)
    with pytest.raises(ValueError, match="grads has 10 elements"):
        fresh.step_range(p0, grads[0][:10], 0, 20)
    with pytest.raises(ValueError, match="grad_coef=0.0"):
        fresh.step_range(p0, grads[0], grad_coef=0.0)
    with pytest.raises(TypeError, match="float64"):
        fresh.step(p0.double(), grads[0])
    with pytest.raises(ValueError, match="state 'exp_avg' has 5 elements"):
        CPUAdam(N).load_state_dict(
            {"step": 1, "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}
        )


# ---- low-precision copy-out, bit for bit --------------------------------------------------------------
def f32(*patterns: int) -> torch.Tensor:
    return torch.from_numpy(np.array(patterns, dtype=np.uint32).view(np.float32).copy())


BF16_EDGES = f32(
    0x3F808000,  # 1 + 2^-8: tie, even -> 1.0
    0x3F818000,  # tie, odd -> up
    0x3F808001,
    0x3F807FFF,  # just above / below a tie
    0x7F7FFFFF,
    0xFF7FFFFF,  # +-max float: round up to +-inf
    0x7F7F7FFF,  # largest that stays finite
    0x7F800000,
    0xFF800000,  # +-inf
    0x7FC00000,
    0xFFC00000,
    0x7F800001,
    0xFF812345,
    0x7FFFFFFF,  # quiet / signalling / payload NaNs
    0x00000001,
    0x00008000,
    0x00018000,
    0x007FFFFF,
    0x807FFFFF,
    0x00800000,  # subnormals, ties, min normal
    0x80000000,
    0x00000000,  # -0.0, +0.0
)
FP16_EDGES = f32(
    0x477FE000,
    0x477FEFFF,
    0x477FF000,
    0x477FFFFF,
    0x47800000,  # 65504, just below 65520, 65520 (-> inf), ...
    0xC77FF000,
    0x7F7FFFFF,
    0x33800000,
    0x33000000,
    0x33000001,
    0x33400000,
    0x32FFFFFF,  # 2^-24, 2^-25 (tie -> 0), just above, 1.5*2^-25
    0x38800000,
    0x387FFFFF,
    0x387FC000,
    0x387FE000,  # 2^-14 (min normal), just below, subnormal ties
    0x34400000,
    0x34C00000,  # 3*2^-24 / 2: tie between 1 and 2 (-> 2) ; 3*2^-23/2 : tie between 3 and 4 (->4)
    0x3F801000,
    0x3F803000,
    0x3F800FFF,  # 1 + 2^-11 tie (even), 1 + 3*2^-11 (odd -> up), below tie
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0xFFC00000,
    0x7F800001,
    0xFF812345,
    0x7FA00000,
    0x7FFFFFFF,
    0x00000001,
    0x807FFFFF,
    0x80000000,
    0x00000000,
)


def lowp_cases(edges: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10)
    any_bits = torch.randint(-(2**31), 2**31, (200_000,), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    return torch.cat(
        [
            edges,
            any_bits.view(torch.float32),
            torch.randn(50_000, generator=gen) * 1e3,
            torch.randn(50_000, generator=gen) * 1e-6,
        ]
    )


@pytest.mark.parametrize("dtype,edges", [(torch.bfloat16, BF16_EDGES), (torch.float16, FP16_EDGES)])
def test_copy_out_equals_torch_bit_for_bit(dtype, edges):
    x = lowp_cases(edges)
    expect = bits(x.to(dtype))
    out = torch.empty(x.numel(), dtype=dtype)
    copy_to_lowp(x, out)
    np.testing.assert_array_equal(bits(out), expect)
    # The fused path, AdamW with lr = 0 and zero gradients: every weight (inf, NaN, -0.0 too) stays as it
    # is (signalling NaNs come out quiet, as from any float op), so the copy-out equals x.to(dtype).
    p, fused = x.clone(), torch.full_like(out, 7.0)
    CPUAdam(x, lr=0.0, weight_decay=0.1).step(p, torch.zeros_like(x), fused)
    np.testing.assert_array_equal(bits(fused), expect)
    # Every optimizer with a real step: the copy-out equals the updated master weights' conversion.
    finite = torch.where(x.isfinite(), x, 1.0)
    grads = torch.randn(x.numel(), generator=torch.Generator().manual_seed(11))
    for opt in (
        CPUAdam(x, lr=1e-3, weight_decay=0.1),
        CPUAdam(x, lr=1e-3, adamw_mode=False, weight_decay=0.1),
        CPULion(x, lr=1e-4, weight_decay=0.1),
    ):
        p, fused = finite.clone(), torch.full_like(out, 7.0)
        opt.step(p, grads, fused)
        np.testing.assert_array_equal(bits(fused), bits(p.to(dtype)))


def test_fp16_numpy_destination_and_edge_values():
    x = FP16_EDGES
    out = np.empty(x.numel(), np.float16)
    copy_to_lowp(x, out)
    np.testing.assert_array_equal(out.view(np.uint16), bits(x.to(torch.float16)))
    assert out[2] == np.inf and out[0] == 65504 and out[8] == 0 and out[9] == np.float16(2**-24)
    assert bits(BF16_EDGES.to(torch.bfloat16))[4] == 0x7F80  # max float rounds to inf


def test_compile_kernels_reports_seconds():
    first = compile_kernels()
    assert set(first.seconds) == {"adam", "adam_bf16", "adam_int8", "lion", "lowp"}
    assert all(t >= 0 for t in first.seconds.values())
    assert first.total_s == pytest.approx(sum(first.seconds.values()))
    again = compile_kernels()  # everything is loaded now: nothing compiles
    assert again.compiled == 0 and first.compiled >= 0 and again.cache_dir
