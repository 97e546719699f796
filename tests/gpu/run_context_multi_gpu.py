"""Context-parallel attention over NCCL on 2 GPUs, against attention over the whole sequence:

    torchrun --nproc-per-node 2 tests/gpu/run_context_multi_gpu.py

cp = the world size (2). Every rank draws the same seeded inputs (q ``[2, 8, 2048, 64]``, k and v on 2 kv
heads: grouped-query attention, and the output's upstream gradient), computes the reference
``F.scaled_dot_product_attention`` over the whole sequence in float32 and runs
``plait.parallel.context.ring_attention`` / ``all_to_all_attention`` on its zigzag shard
(``shard_sequence``); the output and the q/k/v gradients of all ranks are all-gathered and put back in
order (``unshard_sequence``). float32 (the memory-efficient kernel; tolerance 1e-5 relative l2, as on CPU)
and bfloat16 (the kernel SDPA picks, cuDNN on an H100, against float32 attention on the same bf16 inputs:
one rounding of the output to bf16 is 2^-8 / sqrt(3) ~ 2.3e-3 relative in l2, the gradients take two or
three such roundings; tolerance 1e-2, as tests/gpu/run_context_gpu.py), causal, bidirectional, and
bidirectional with a key padding mask (``test_context_parallel.key_mask``). Unlike run_context_gpu.py (the
ring's steps emulated in one process) the K/V and their gradients really travel between the GPUs.
Rank 0 prints one line per check; every rank exits 1 on any failure. Not collected by pytest (needs GPUs).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import rel_err  # noqa: E402
from test_context_parallel import key_mask  # noqa: E402

from plait.parallel import init_distributed  # noqa: E402
from plait.parallel.context import (
    all_to_all_attention,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)  # noqa: E402

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 8, 2, 2048, 64
METHODS = {"ring": ring_attention, "all_to_all": all_to_all_attention}


def inputs(dtype, device) -> list[torch.Tensor]:
    """q, k, v and the output's gradient, in ``dtype``, the same on every rank."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device, generator=g)
    k, v = (
        torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, device=device, generator=g) for _ in range(2)
    )
    up = torch.randn(q.shape, device=device, generator=g)
    return [t.to(dtype) for t in (q, k, v, up)]


def reference(q, k, v, up, causal: bool, keep=None) -> list[torch.Tensor]:
    """Output and q/k/v gradients of float32 attention over the whole sequence (``keep [b, s]``: keys)."""
    leaves = [
        t.to(torch.float32, copy=True).requires_grad_() for t in (q, k, v)
    ]  # copies: q, k, v stay as they are
    mask = None if keep is None else keep[:, None, None, :]
    out = F.scaled_dot_product_attention(
        *leaves, attn_mask=mask, is_causal=causal, enable_gqa=HEADS != KV_HEADS
    )
    out.backward(up.float())
    return [out.detach()] + [t.grad for t in leaves]


def gathered(t: torch.Tensor, group) -> torch.Tensor:
    """Every rank's shard of ``t`` (sequence dim 2), back in sequence order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return unshard_sequence(parts, dim=2)


def check(
    method: str, dtype, causal: bool, group, device, masked: bool = False
) -> tuple[bool, str]:
    """One method against ``reference``; ``masked``: bidirectional with ``key_mask``'s padding (sequence 0
    all padding past its first 2 tokens: rank 1's K/V hold none of its keys)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, up = inputs(dtype, device)
    keep = key_mask(SEQ).to(device) if masked else None
    want = reference(q, k, v, up, causal, keep)
    ql, kl, vl = (shard_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v))
    local_keep = None if keep is None else shard_sequence(keep, cp, rank)
    out = METHODS[method](ql, kl, vl, group, causal=causal, key_padding_mask=local_keep)
    out.backward(shard_sequence(up, cp, rank, dim=2))
    got = [gathered(t, group) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
    errs = [rel_err(a.float(), b) for a, b in zip(got, want)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ok = max(errs) <= tol
    return ok, (
        f"{method} cp={cp} {dtype} causal={causal} masked={masked}: out/dq/dk/dv rel err "
        f"{' '.join(f'{e:.1e}' for e in errs)} (tol {tol:.0e}) {'ok' if ok else 'FAILED'}"
    )


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    info = init_distributed(backend="nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(info.world_size)))
    failures = 0
    for method in METHODS:
        for dtype in (torch.float32, torch.bfloat16):
            for causal, masked in ((True, False), (False, False), (False, True)):
                ok, line = check(method, dtype, causal, group, device, masked)
                failures += not ok
                if info.rank == 0:
                    print(line, flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
