"""GPU check of the context-parallel attention blocks and of RMSNorm's backward, run on a lent GPU:

    python tests/gpu/run_context_gpu.py

1. The ring's steps (``plait.parallel.context.forward_step`` / ``backward_step``) for every rank of cp = 2
   and 4, emulated in one process (``tests/test_context_parallel.emulate_ring``: the same block kernels,
   no communication), against ``F.scaled_dot_product_attention`` over the whole sequence: float32 (the
   memory-efficient kernel; tolerance 1e-5 as on CPU) and bfloat16 (the kernel SDPA picks, cuDNN on an
   H100, and also the memory-efficient one forced with ``sdpa_kernel``; against float32
   attention on the same bf16 inputs: one rounding of the output to bf16 is 2^-8 / sqrt(3) ~ 2.3e-3
   relative in l2, the gradients take two or three such roundings; tolerance 1e-2), causal and
   bidirectional (also with a key padding mask: the memory-efficient kernel with a bias, rows of blocks
   that see no key), grouped-query attention (8 query heads, 2 kv heads), sequence 1024, head dim 64.
2. ``plait.layers.RMSNorm`` against ``F.rms_norm(x) * w`` on CUDA: output, input and weight gradients
   bitwise equal (the same fused kernels), float32 and bfloat16.
Prints one line per check; exit 1 on failure.
"""

import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import rel_err
from test_context_parallel import emulate_ring, key_mask

from plait.layers.norm import _RMSNormWeight


def ring_check(
    cp: int, dtype, causal: bool, masked: bool = False, efficient: bool = False
) -> tuple[bool, str]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 1024, 64, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 1024, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    up = torch.randn(q.shape, device="cuda", generator=g).to(dtype)
    keep = key_mask(1024).cuda() if masked else None
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(
        *leaves,
        attn_mask=None if keep is None else keep[:, None, None, :],
        is_causal=causal,
        enable_gqa=True,
    )
    out.backward(up.float())
    want = [out.detach()] + [t.grad for t in leaves]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]) if efficient else contextlib.nullcontext():
        got = emulate_ring(q, k, v, up, cp, causal, keep)
    errs = [rel_err(a.float(), b) for a, b in zip(got, want)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ok = max(errs) <= tol
    return ok, (
        f"ring cp={cp} {dtype} causal={causal} masked={masked} efficient={efficient}: out/dq/dk/dv rel err "
        f"{' '.join(f'{e:.1e}' for e in errs)} (tol {tol:.0e}) {'ok' if ok else 'FAILED'}"
    )


def norm_check(dtype) -> tuple[bool, str]:
    g = torch.Generator(device="cuda").manual_seed(1)
    x0 = torch.randn(4, 512, 1024, device="cuda", generator=g).to(dtype)
    w0 = (0.5 + torch.rand(1024, device="cuda", generator=g)).to(dtype)
    up = torch.randn(x0.shape, device="cuda", generator=g).to(dtype)
    results = []
    for fn in (
        lambda x, w: F.rms_norm(x, (1024,), None, 1e-6) * w,
        lambda x, w: _RMSNormWeight.apply(x, w, 1e-6),
    ):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w)
        out.backward(up)
        results.append((out.detach(), x.grad, w.grad))
    ok = all(torch.equal(a, b) for a, b in zip(*results))
    return (
        ok,
        f"RMSNorm {dtype}: output, dx, dw bitwise equal to F.rms_norm(x) * w: {'ok' if ok else 'FAILED'}",
    )


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    lines, failures = [], 0
    checks = [
        (ring_check, (cp, dtype, causal))
        for cp in (2, 4)
        for dtype in (torch.float32, torch.bfloat16)
        for causal in (True, False)
    ]
    checks += [
        (ring_check, (cp, dtype, False, True))
        for cp in (2, 4)
        for dtype in (torch.float32, torch.bfloat16)
    ]
    checks += [(ring_check, (2, torch.bfloat16, causal, False, True)) for causal in (True, False)]
    checks += [(norm_check, (dtype,)) for dtype in (torch.float32, torch.bfloat16)]
    for fn, args in checks:
        ok, line = fn(*args)
        failures += not ok
        lines.append(line)
        print(line, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
