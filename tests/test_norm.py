"""plait.layers.norm.RMSNorm: the gradients of ``F.rms_norm(x) * w`` while keeping only ``x`` and ``w``."""

import pytest
import torch
import torch.nn.functional as F

from plait.layers.norm import RMSNorm, _RMSNormWeight

H = 64


def separate_ops(x, w, eps=1e-6):
    """The two ops RMSNorm fuses, as Hugging Face's Llama rounds them (and as plait ran them before)."""
    return F.rms_norm(x, (x.shape[-1],), None, eps) * w


def plait_rms(x, w):
    """What ``RMSNorm.forward`` runs (its weight passed in, so the test owns the leaf)."""
    return _RMSNormWeight.apply(x, w, 1e-6)


def grads(fn, x0, w0, g):
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    out = fn(x, w)
    out.backward(g)
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_the_separate_ops(dtype):
    """Output and weight gradient bitwise (same kernels, the normalization recomputed in backward by the
    same deterministic kernel). The input gradient is the same formula in float32 with the mean over h
    summed in another order: each of the h terms is off by at most 2^-24 relative, so |delta dx| <=
    h * 2^-24 * max|dx| (then one rounding to dtype); bf16 is compared after its own rounding (2^-8)."""
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 16, H, generator=gen).to(dtype)
    w0 = (0.5 + torch.rand(H, generator=gen)).to(dtype)
    g = torch.randn(4, 16, H, generator=gen).to(dtype)
    want, got = grads(separate_ops, x0, w0, g), grads(plait_rms, x0, w0, g)
    norm = RMSNorm(H, dtype=dtype)
    norm.weight.data.copy_(w0)
    assert torch.equal(norm(x0), want[0])
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    scale = want[1].abs().max().item()
    tol = H * 2.0**-24 * scale + (2.0**-8 * scale if dtype == torch.bfloat16 else 0.0)
    err = (got[1].float() - want[1].float()).abs().max().item()
    assert err <= tol, (err, tol)
    broken = (got[1].float() * (1 + 2.0**-7)) if dtype == torch.float32 else got[1].float() * 1.01
    assert (broken - want[1].float()).abs().max().item() > tol  # a gradient off by that much fails


def saved_bytes(fn, x, w):
    """Bytes autograd keeps from forward to backward for ``fn(x, w)`` (distinct storages)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w)
    return sum(seen.values())


def test_rmsnorm_keeps_only_its_input_and_weight():
    """The separate product keeps the normalized ``[..., h]`` tensor for the weight gradient as well;
    RMSNorm keeps the input and the weight only (the input is saved once for both gradients)."""
    x = torch.randn(4, 16, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(H, dtype=torch.bfloat16, requires_grad=True)
    want = x.numel() * 2 + w.numel() * 2
    assert saved_bytes(plait_rms, x, w) == want
    assert saved_bytes(separate_ops, x, w) >= want + x.numel() * 2
