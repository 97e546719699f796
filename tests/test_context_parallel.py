"""plait.parallel.context: ring and all-to-all attention over a sequence split across cp gloo ranks, against
single-process attention over the whole sequence (float32; output and the gradients of q, k and v).

Tolerance 1e-5 relative (l2): the ring merges per-block softmax results through their log-sum-exp and the
all-to-all path permutes tokens, so each row's sums run in another order than the reference's: a few float32
ulps (2^-24 ~ 6e-8) per term; measured ~1e-7. A merge that drops the log-sum-exp rescaling fails it by
orders of magnitude (``broken`` below). Whole models and the engine: tests/test_context_parallel_engine.py.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import rel_err
from plait.parallel import context as C
from plait.testing import run_distributed

B, HEADS, D = 2, 4, 8


def inputs(seq: int, kv_heads: int):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, HEADS, seq, D, generator=g)
    k, v = (torch.randn(B, kv_heads, seq, D, generator=g) for _ in range(2))
    return q, k, v, torch.randn(B, HEADS, seq, D, generator=g)


def key_mask(seq: int) -> torch.Tensor:
    """``[B, seq]`` keys to attend to: sequence 0 has only its first 2 tokens (inside rank 0's first chunk for
    every cp and seq here, so every other rank's K/V is all padding: blocks whose rows see no key), sequence
    1 is padded over its last 3 tokens."""
    keep = torch.ones(B, seq, dtype=torch.bool)
    keep[0, 2:] = False
    keep[1, seq - 3 :] = False
    return keep


def reference(seq, kv_heads, causal, masked=False):
    q, k, v, up = (t.requires_grad_() if i < 3 else t for i, t in enumerate(inputs(seq, kv_heads)))
    mask = key_mask(seq)[:, None, None, :] if masked else None
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=kv_heads != HEADS
    )
    out.backward(up)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def cp_body(seq, kv_heads, causal, method, broken=False, masked=False):
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    q, k, v, up = (C.shard_sequence(t, cp, rank, dim=2) for t in inputs(seq, kv_heads))
    keep = C.shard_sequence(key_mask(seq), cp, rank) if masked else None
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if broken:  # merging without the log-sum-exp rescaling: a plain sum of the partial outputs
        C._merge = lambda out, lse, part, part_lse: (out.add_(part.float()), lse.copy_(part_lse))
    fn = C.ring_attention if method == "ring" else C.all_to_all_attention
    out = fn(q, k, v, group, causal=causal, key_padding_mask=keep)
    out.backward(up)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def check(results, seq, kv_heads, causal, what, tol=1e-5, masked=False):
    want = reference(seq, kv_heads, causal, masked)
    got = [C.unshard_sequence([r[i] for r in results], dim=2) for i in range(4)]
    errs = {name: rel_err(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    assert all(e <= tol for e in errs.values()), (what, errs)
    return errs


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["ring", "all_to_all"])
@pytest.mark.parametrize("causal", [True, False])
def test_context_parallel_attention_matches_whole_sequence(cp, method, causal):
    """Multi-head (4 heads) and grouped-query (4 query, 2 or 4 kv heads) attention; seq 24 (cp=2) / 16 (cp=4)."""
    seq = 24 if cp == 2 else 16
    kv_heads = 2 if cp == 2 else 4  # all-to-all needs kv heads divisible by cp
    check(
        run_distributed(cp_body, cp, seq, kv_heads, causal, method),
        seq,
        kv_heads,
        causal,
        f"{method} cp={cp} causal={causal}",
    )


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_key_padding_mask_matches_whole_sequence(cp, method):
    """Bidirectional attention with padded keys (BERT's attention_mask), ``key_mask``: whole key chunks of
    padding included, where a block's rows see no key at all (they merge with weight 0, not nan)."""
    seq = 24 if cp == 2 else 16
    kv_heads = 2 if cp == 2 else 4
    check(
        run_distributed(cp_body, cp, seq, kv_heads, False, method, False, True),
        seq,
        kv_heads,
        False,
        f"{method} cp={cp} masked",
        masked=True,
    )


def test_a_merge_without_rescaling_fails_the_tolerance():
    results = run_distributed(cp_body, 2, 24, 2, True, "ring", True)
    with pytest.raises(AssertionError):
        check(results, 24, 2, True, "broken merge")


def test_sharding_round_trip_positions_and_errors():
    x = torch.arange(2 * 16).view(2, 16)
    parts = [C.shard_sequence(x, 4, r) for r in range(4)]
    assert parts[1].tolist()[0] == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    assert torch.equal(C.unshard_sequence(parts), x)
    assert C.positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    with pytest.raises(
        ValueError, match=r"sequence length 18 is not a multiple of 2 x cp = 8 .* by 6 tokens"
    ):
        C.shard_sequence(torch.zeros(1, 18), 4, 0)
    q, k = torch.zeros(1, 4, 8, 2), torch.zeros(1, 3, 8, 2)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of kv heads \(3\)"):
        C.ring_attention(q, k, k, None)


@torch.no_grad()  # as inside the autograd.Function
def emulate_ring(q, k, v, up, cp: int, causal: bool, keep=None):
    """The ring's per-step computation (``forward_step``/``backward_step``) for every rank of cp in one
    process, without communication: ``(out, dq, dk, dv)`` over the whole sequence (tests/gpu runs it on CUDA,
    where the block kernels differ); ``keep [b, s]``: a key padding mask (bidirectional)."""
    scale = q.shape[-1] ** -0.5
    shard = lambda t, r: C.shard_sequence(t, cp, r, dim=2)  # noqa: E731
    keeps = [None if keep is None else C.shard_sequence(keep, cp, j) for j in range(cp)]
    kvs = [torch.stack([shard(k, j), shard(v, j)]) for j in range(cp)]
    dkvs = [torch.zeros(kv.shape, dtype=torch.float32, device=q.device) for kv in kvs]
    outs, dqs = [], []
    for r in range(cp):
        qr = shard(q, r)
        out = torch.zeros(qr.shape, device=q.device)
        lse = torch.full(out.shape[:3], float("-inf"), device=q.device)
        for j in range(cp):
            C.forward_step(qr, kvs[j], out, lse, r, j, causal, scale, keeps[j])
        out = out.to(q.dtype)
        if (
            keep is not None
        ):  # as _RingAttention: a sequence of padding only gets 0 gradients, not nan
            lse.masked_fill_(lse == -torch.inf, 0.0)
        dq = torch.zeros(out.shape, dtype=torch.float32, device=q.device)
        for j in range(cp):
            C.backward_step(
                shard(up, r), qr, out, lse, kvs[j], dq, dkvs[j], r, j, causal, scale, keeps[j]
            )
        outs.append(out)
        dqs.append(dq.to(q.dtype))
    return (
        C.unshard_sequence(outs, dim=2),
        C.unshard_sequence(dqs, dim=2),
        C.unshard_sequence([d[0].to(k.dtype) for d in dkvs], dim=2),
        C.unshard_sequence([d[1].to(v.dtype) for d in dkvs], dim=2),
    )


@pytest.mark.parametrize("causal, masked", [(True, False), (False, False), (False, True)])
def test_emulated_ring_matches_whole_sequence(causal, masked):
    """The same steps in one process (what tests/gpu/run_context_gpu.py runs on CUDA): cp=3, GQA; with a key
    padding mask when bidirectional."""
    want = reference(36, 2, causal, masked)
    got = emulate_ring(*inputs(36, 2), 3, causal, key_mask(36) if masked else None)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) <= 1e-5, errs
