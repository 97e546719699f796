"""Probe (issue 16): which fused kernel SDPA picks for one ring block on this GPU, and each kernel's time
for a block's forward and backward, through the aten ops plait's ring attention calls.

    python benchmarks/probe_attention_kernels.py [--seq 16384] [--heads 16] [--dim 128]

Prints SDPA's choice (``torch._fused_sdp_choice``) for causal and full blocks in bf16, then for each kernel
(flash, memory-efficient, cuDNN) the mean milliseconds of the forward with log-sum-exp and of the backward
given that output, and the largest difference from SDPA's own forward.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def timed(fn, reps: int = 5) -> tuple[float, object]:
    out = fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3, out


def kernels(q, k, v, dout, causal, scale):
    def flash():
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
        off = torch.zeros((), dtype=torch.uint64, device=q.device)
        back = lambda: aten._scaled_dot_product_flash_attention_backward(  # noqa: E731
            dout,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            off,
            scale=scale,
        )
        return out, back

    def efficient():
        out, lse = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )[:2]
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        back = lambda: aten._scaled_dot_product_efficient_attention_backward(  # noqa: E731
            dout,
            q,
            k,
            v,
            None,
            out,
            lse,
            zero,
            zero,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return out, back

    def cudnn():
        res = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        out, lse, cq, ck, mq, mk, seed, off = res[:8]
        print(
            f"    cudnn lse {tuple(lse.shape)} strides {lse.stride()} cum_seq {type(cq).__name__} seed {seed}"
        )
        back = lambda: aten._scaled_dot_product_cudnn_attention_backward(  # noqa: E731
            dout, q, k, v, out, lse, seed, off, None, cq, ck, mq, mk, 0.0, causal, scale=scale
        )
        return out, back

    return {"flash": flash, "efficient": efficient, "cudnn": cudnn}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(
            1, args.heads, args.seq, args.dim, device="cuda", generator=g, dtype=torch.bfloat16
        )
        for _ in range(4)
    )
    scale = args.dim**-0.5
    print(torch.cuda.get_device_name(), torch.__version__, "cudnn", torch.backends.cudnn.version())
    for causal in (True, False):
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=scale)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).float()
        ms_sdpa, _ = timed(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        )
        name = torch.nn.attention.SDPBackend(choice).name
        print(f"causal={causal}: SDPA picks {name}; SDPA forward {ms_sdpa:.2f} ms")
        for name, make in kernels(q, k, v, dout, causal, scale).items():
            try:
                ms_f, (out, back) = timed(make)
                ms_b, grads = timed(back)
                err = (out.float() - want).abs().max().item()
                print(
                    f"  {name:9s} forward {ms_f:7.2f} ms  backward {ms_b:7.2f} ms  max|out - SDPA| {err:.1e}"
                )
            except Exception as exc:  # a kernel this GPU or build does not offer
                print(f"  {name:9s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def masked_check(seq: int = 2048):
    """One block with a key padding bias (as ring attention builds it) through the memory-efficient kernel,
    forward and backward given its own log-sum-exp, against float32 SDPA's autograd, in fp32 and bf16."""
    from plait.parallel.attention_block import _key_bias

    g = torch.Generator(device="cuda").manual_seed(1)
    base = [torch.randn(2, 8, seq, 64, device="cuda", generator=g) for _ in range(4)]
    keep = torch.ones(2, seq, dtype=torch.bool, device="cuda")
    keep[0, seq // 3 :] = False
    leaves = [t.clone().requires_grad_() for t in base[:3]]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=keep[:, None, None, :])
    out.backward(base[3])
    want = [out.detach()] + [t.grad for t in leaves]
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, dout = (t.to(dtype) for t in base)
        bias = _key_bias(keep, q)
        o, lse = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False)[:2]
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        for name, b in (("expanded bias", bias), ("contiguous bias", bias.contiguous())):
            grads = aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, b, o, lse, zero, zero, 0.0, [True, True, True, False], False
            )[:3]
            errs = [((a.float() - w).norm() / w.norm()).item() for a, w in zip([o, *grads], want)]
            print(
                f"masked block {dtype} {name}: out/dq/dk/dv rel err {' '.join(f'{e:.1e}' for e in errs)}"
            )
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
            o = F.scaled_dot_product_attention(*leaves, attn_mask=keep[:, None, None, :])
        o.backward(dout)
        errs = [
            ((a.float() - w).norm() / w.norm()).item()
            for a, w in zip([o] + [t.grad for t in leaves], want)
        ]
        print(
            f"masked block {dtype} SDPA's own efficient backward: rel err {' '.join(f'{e:.1e}' for e in errs)}"
        )


if __name__ == "__main__":
    masked_check()
    main()
