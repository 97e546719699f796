"""One block of context-parallel attention (``plait.parallel.context``): queries against one K/V chunk by
torch's fused SDPA kernels, returning the log-sum-exp so that blocks merge (Milakov & Gimelshein 2018;
FlashAttention Alg. 1), the backward by the same kernel, and the merge itself.

Shapes: ``q [b, heads, sq, d]``, ``k, v [b, heads or kv_heads, sk, d]``, ``lse [b, heads, sq]`` float32;
``keep [b, sk]`` masks padded keys (True: attend). Design: ``docs/context-parallel.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _key_bias(keep: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Additive bias ``[b, heads, sq, c]`` (an expanded view; 0 or -inf in q's dtype) from a key chunk's
    padding mask ``keep [b, c]`` (True: attend). Its rows are 16-aligned in memory, as the memory-efficient
    kernel needs (torch's SDPA pads its masks the same way)."""
    b, c = keep.shape
    bias = torch.zeros(b, 1, 1, c + (-c % 16), dtype=q.dtype, device=q.device)
    bias[..., :c].masked_fill_(~keep[:, None, None, :], float("-inf"))
    return bias[..., :c].expand(b, q.shape[1], q.shape[2], c)


def _cuda_kernel(q, k, v, causal: bool, scale: float) -> str:
    """The fused kernel torch's SDPA itself picks for this block: "cudnn", "flash" or "efficient" (which
    also stands in for the math fallback: every ring block needs a kernel that returns the log-sum-exp).
    K/V with fewer heads than q ask for a kernel that takes grouped-query attention as it is."""
    gqa = q.shape[1] != k.shape[1]
    q, k, v = (
        t.detach().requires_grad_() for t in (q, k, v)
    )  # a kernel with a backward for these shapes
    try:
        choice = int(
            torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=scale, enable_gqa=gqa)
        )
    except (
        RuntimeError
    ):  # no enabled kernel takes these shapes (e.g. only the memory-efficient one, with GQA)
        return "efficient"
    return {1: "flash", 3: "cudnn"}.get(choice, "efficient")


def _block_forward(q, k, v, causal: bool, scale: float, keep=None):
    """``(out [b, n, sq, d], lse [b, n, sq] float32)`` of softmax attention of q over k, v (same heads), by
    the kernel SDPA picks (``_cuda_kernel``; the CPU flash kernel off CUDA); ``keep [b, sk]`` masks padded
    keys (then ``causal`` is False; the memory-efficient kernel on CUDA, as only it takes a bias). A row
    with no key to attend to gets ``out`` 0 and ``lse`` -inf, whatever the kernel returns, so merging
    ignores it."""
    aten = torch.ops.aten
    if keep is not None:
        bias = _key_bias(keep, q)
        if q.is_cuda:
            out, lse = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, False, scale=scale
            )[:2]
        else:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=bias, scale=scale
            )
        empty = ~keep.any(-1)[:, None, None]
        return out.masked_fill(empty[..., None], 0.0), lse[..., : q.shape[2]].float().masked_fill(
            empty, -torch.inf
        )
    kernel = _cuda_kernel(q, k, v, causal, scale) if q.is_cuda else "cpu"
    if kernel == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
    elif kernel == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
    elif kernel == "efficient":
        out, lse = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )[:2]
    else:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
    return out, lse.reshape(lse.shape[:3])[..., : q.shape[2]].float()  # cuDNN's is [b, n, sq, 1]


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep=None):
    """``(dq, dk, dv)`` of one block given the rows' merged ``out`` and ``lse`` (``docs/context-parallel.md``), by the
    kernel ``_block_forward`` used; ``keep`` as there."""
    bias = None if keep is None else _key_bias(keep, q)
    kernel = (
        "cpu"
        if not q.is_cuda
        else "efficient"
        if bias is not None
        else _cuda_kernel(q, k, v, causal, scale)
    )
    if kernel == "cudnn":
        return _cudnn_backward(dout, q, k, v, out, lse, causal, scale)
    if kernel == "flash":
        return _flash_backward(dout, q, k, v, out, lse, causal, scale)
    if kernel == "efficient":
        return _efficient_backward(dout, q, k, v, out, lse, causal, scale, bias)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


# dense inputs: no cumulative sequence lengths; no dropout: the RNG state is unused
def _cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse.unsqueeze(-1),
        zero,
        zero,
        None,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        scale=scale,
    )


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
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
        offset,
        scale=scale,
    )


def _efficient_backward(dout, q, k, v, out, lse, causal: bool, scale: float, bias):
    lse = F.pad(
        lse, (0, -lse.shape[-1] % 32)
    )  # the memory-efficient kernel keeps its lse padded to 32 rows
    # its half-precision backward reads ``out`` right only in the [b, s, n, d] memory layout its forward writes
    out, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (out, dout))
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        k,
        v,
        bias,
        out,
        lse,
        zero,
        zero,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )[:3]


def _merge(out, lse, part, part_lse):
    """Combine two partial softmax results over disjoint keys (float32 ``out``, ``lse``), in place."""
    new = torch.logaddexp(lse, part_lse)
    ref = new.masked_fill(new == -torch.inf, 0.0)  # rows with no key yet: both weights 0, not nan
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).add_(
        part.float() * torch.exp(part_lse - ref).unsqueeze(-1)
    )
    lse.copy_(new)


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads repeated to ``heads`` (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum a gradient of repeated kv heads back to ``kv_heads``."""
    b, n, s, d = grad.shape
    return grad if n == kv_heads else grad.view(b, kv_heads, n // kv_heads, s, d).sum(2)
