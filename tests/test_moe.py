"""plait.layers.MoE against a reference written here token by token (float64 logits, each token's k experts
run one at a time, no sorting, no grouped GEMM): output, routing and every gradient to 1e-5 relative (l2), in
float32. The layer permutes tokens and sums each token's expert outputs in another order than the
reference: a few float32 ulps per term (measured ~1e-7); the weights of a wrong router order or an
unnormalized top-k differ by O(1) (``test_a_wrong_router_order_fails_the_tolerance``).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from plait.layers.init import init_parameters
from plait.layers import MoE
from plait.layers.moe import balance_loss, dispatch, expert_capacity, grouped_mm, route, z_loss
from plait.parallel.experts import inverse_permutation, stable_order

H, FFN, E, T = 16, 8, 4, 24


def layer(**kw):
    moe = MoE(H, FFN, E, kw.pop("top_k", 2), **kw)
    init_parameters(moe, seed=3)
    return moe


def tokens():
    return torch.randn(2, T // 2, H, generator=torch.Generator().manual_seed(5))


def reference(moe, x, order, normalize, capacity=None):
    """Per token: float64 router, the top-k by the order's rule, each chosen expert run on its own (in token
    order, an expert past ``capacity`` assignments skipped), weighted sum, plus the shared MLP."""
    flat = x.reshape(-1, H)
    logits = flat.double() @ moe.router_weight.double().T
    probs = logits.softmax(-1)
    taken = [0] * E
    rows = []
    for t in range(flat.shape[0]):
        scores = probs[t] if order == "softmax_topk" else logits[t]
        top = torch.topk(scores + moe.expert_bias.double(), moe.top_k).indices
        w = scores[top]
        w = (w / w.sum() if normalize else w) if order == "softmax_topk" else w.softmax(-1)
        out = torch.zeros(H)
        for j, e in enumerate(top.tolist()):
            if capacity is not None and taken[e] >= capacity:
                continue
            taken[e] += 1
            h = F.silu(flat[t] @ moe.gate_proj[e].T) * (flat[t] @ moe.up_proj[e].T)
            out = out + w[j].float() * (h @ moe.down_proj[e].T)
        rows.append(out)
    y = torch.stack(rows).view(x.shape)
    return (y + moe.shared(x) if moe.shared is not None else y), logits, probs


def grads(moe, y, up):
    moe.zero_grad()
    (y * up).sum().backward()
    return {n: p.grad.clone() for n, p in moe.named_parameters()}


@pytest.mark.parametrize(
    "order, normalize, capacity_factor, shared",
    [
        ("softmax_topk", True, None, 0),
        ("softmax_topk", False, None, 12),
        ("topk_softmax", True, None, 0),
        ("softmax_topk", True, 0.75, 0),
    ],
)
def test_moe_matches_the_token_by_token_reference(order, normalize, capacity_factor, shared):
    """Dropless and capacity (0.75: a quarter of the assignments dropped), with and without shared experts."""
    moe = layer(
        router_order=order,
        normalize_topk=normalize,
        capacity_factor=capacity_factor,
        shared_ffn_hidden_size=shared,
    )
    x = tokens()
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    y, aux = moe(x)
    got = grads(moe, y, up)
    cap = None if capacity_factor is None else expert_capacity(T, 2, E, capacity_factor)
    want_y, logits, probs = reference(moe, x, order, normalize, cap)
    want = grads(moe, want_y, up)
    assert rel_err(y, want_y) <= 1e-5
    for name in want:
        assert rel_err(got[name], want[name]) <= 1e-5, name
    routed = torch.bincount(
        torch.topk(probs if order == "softmax_topk" else logits, 2).indices.reshape(-1), minlength=E
    )
    assert torch.equal(aux.tokens_per_expert, routed)
    assert int(aux.dropped) == (0 if cap is None else int((routed - routed.clamp(max=cap)).sum()))
    if capacity_factor is not None:
        assert int(aux.dropped) > 0


def test_a_wrong_router_order_fails_the_tolerance():
    moe = layer(router_order="softmax_topk", normalize_topk=False)
    x = tokens()
    y, _ = moe(x)
    assert rel_err(y, reference(moe, x, "softmax_topk", True)[0]) > 1e-2


def test_losses_equal_their_formulas():
    """Switch balance loss E * sum_i f_i P_i (f_i: tokens routed to i over T, k per token) and the z-loss,
    against the formulas in float64 (``route`` works in float32: 1e-6)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    r = route(logits, 2)
    probs = logits.softmax(-1)
    f = [sum(int(e in row) for row in r.experts.tolist()) / T for e in range(E)]
    want = E * sum(f[i] * probs[:, i].mean().item() for i in range(E))
    assert balance_loss(r.probs, r.experts).item() == pytest.approx(want, rel=1e-6)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / T
    assert z_loss(logits).item() == pytest.approx(z, rel=1e-6)
    balanced = torch.full((T, E), 0.0, dtype=torch.float64)  # uniform probs, even routing: loss = k
    even = torch.arange(T * 2).remainder(E).view(T, 2)
    assert balance_loss(balanced.softmax(-1), even).item() == pytest.approx(2.0)
    moe = layer(balance_loss_coef=0.1, z_loss_coef=0.01)
    _, aux = moe(tokens())
    assert aux.loss.item() == pytest.approx(
        0.1 * aux.balance.item() + 0.01 * aux.z.item(), rel=1e-6
    )


def test_grouped_gemm_equals_a_matmul_per_expert():
    """``grouped_mm`` (torch._grouped_mm on aligned sizes, an empty expert included) against a loop."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(10, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    counts = torch.tensor([4, 0, 6])
    want = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    assert torch.allclose(grouped_mm(x, w, counts), want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(grouped_mm(x, w, counts, grouped=False), want, rtol=1e-6, atol=1e-6)
    x6, w6 = x[:, :6].contiguous(), w[..., :6].contiguous()  # 24-byte rows: the per-expert fallback
    assert torch.allclose(
        grouped_mm(x6, w6, counts), torch.cat([x6[:4] @ w6[0].T, x6[4:] @ w6[2].T]), atol=1e-6
    )


def test_dispatch_keeps_token_order_within_experts_and_the_capacity():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    slots, rows, dropped = dispatch(experts, 3, None)
    assert (
        slots.tolist() == [0, 2, 4, 7, 1, 5, 6, 3]
        and rows.tolist() == [4, 3, 1]
        and int(dropped) == 0
    )
    slots, rows, dropped = dispatch(experts, 3, 2)
    assert slots.tolist() == [0, 2, 1, 5, 3] and rows.tolist() == [2, 2, 1] and int(dropped) == 3


def test_auxiliary_loss_free_bias_selects_but_does_not_weigh():
    """DeepSeek-V3: the bias moves the selection toward under-loaded experts; the weights stay the unbiased
    scores; ``update_expert_bias`` steps it by u * sign(mean load - load) and restarts the count."""
    moe = layer(bias_update_rate=0.5)
    moe.train()
    x = tokens()
    moe(x)
    seen = moe.tokens_seen.clone()
    assert seen.sum().item() == T * 2
    moe.update_expert_bias()
    assert torch.equal(moe.expert_bias, 0.5 * torch.sign(seen.mean() - seen))
    assert moe.tokens_seen.sum().item() == 0
    y, _ = moe(x)  # the reference adds the same bias to its selection scores only
    assert rel_err(y, reference(moe, x, "softmax_topk", True)[0]) <= 1e-5


def test_bad_arguments_name_the_numbers():
    with pytest.raises(ValueError, match=r"top_k=5 must lie in \[1, num_experts=4\]"):
        MoE(H, FFN, E, 5)
    with pytest.raises(ValueError, match="unknown router_order 'sigmoid'"):
        MoE(H, FFN, E, 2, router_order="sigmoid")
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(H, FFN, E, 2, capacity_factor=0.0)


# ---- expert parallelism: the experts split over ep ranks, tokens exchanged by all-to-all -------------------------
def expert_parallel_body(ep, capacity_factor, shared):
    """Each rank routes its own tokens (seed 10 + rank) through the experts split over the ep ranks; returns its
    output, aux, and every gradient (expert weights: this rank's ``[E/ep, ...]`` shard) of ``(y * up).sum()``."""
    import torch.distributed as dist

    from plait.parallel import ParallelMesh

    mesh = ParallelMesh(ep=ep)
    moe = layer(
        capacity_factor=capacity_factor, shared_ffn_hidden_size=shared, ep_group=mesh.ep_group
    )
    rank = dist.get_rank()
    x = torch.randn(
        2, T // 2, H, generator=torch.Generator().manual_seed(10 + rank)
    ).requires_grad_()
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(20 + rank))
    y, aux = moe(x)
    (y * up).sum().backward()
    return (
        y.detach(),
        aux.tokens_per_expert,
        int(aux.dropped),
        x.grad,
        {n: p.grad.clone() for n, p in moe.named_parameters()},
    )


@pytest.mark.parametrize(
    "ep, capacity_factor, shared", [(2, None, 0), (4, None, 12), (2, 0.75, 0), (4, 0.75, 0)]
)
def test_expert_parallel_equals_every_expert_in_one_process(ep, capacity_factor, shared):
    """ep ranks (gloo), 4 experts split 2 or 1 per rank, dropless or capacity 0.75, against the token-by-token
    reference of each rank's tokens: outputs and input gradients per rank; an expert's gradient (on the rank
    holding it) the sum of every rank's contribution; the router's and shared MLP's each rank's own. 1e-5,
    as ``test_moe_matches_the_token_by_token_reference`` (the all-to-all moves rows, it adds nothing)."""
    from plait.testing import run_distributed

    results = run_distributed(expert_parallel_body, ep, ep, capacity_factor, shared)
    ref = layer(capacity_factor=capacity_factor, shared_ffn_hidden_size=shared)
    cap = None if capacity_factor is None else expert_capacity(T, 2, E, capacity_factor)
    expert_grads = {}
    for rank, (y, counts, dropped, x_grad, got) in enumerate(results):
        x = torch.randn(
            2, T // 2, H, generator=torch.Generator().manual_seed(10 + rank)
        ).requires_grad_()
        up = torch.randn(x.shape, generator=torch.Generator().manual_seed(20 + rank))
        want_y, logits, _ = reference(ref, x, "softmax_topk", True, cap)
        want = grads(ref, want_y, up)
        assert rel_err(y, want_y) <= 1e-5 and rel_err(x_grad, x.grad) <= 1e-5, f"rank {rank}"
        routed = torch.bincount(torch.topk(logits, 2).indices.reshape(-1), minlength=E)
        assert torch.equal(counts, routed) and dropped == int(
            (routed - routed.clamp(max=cap or T * 2)).sum()
        )
        for name, grad in want.items():
            if name in ("gate_proj", "up_proj", "down_proj"):
                expert_grads[name] = expert_grads.get(name, 0) + grad
            else:
                assert rel_err(got[name], grad) <= 1e-5, f"rank {rank}: {name}"
    for rank, (*_, got) in enumerate(results):
        for name, total in expert_grads.items():
            mine = total[rank * E // ep : (rank + 1) * E // ep]
            assert got[name].shape == mine.shape and rel_err(got[name], mine) <= 1e-5, (
                f"rank {rank}: {name}"
            )
    if capacity_factor is not None:
        assert sum(r[2] for r in results) > 0


def uneven_experts_body():
    from plait.parallel import ParallelMesh

    with pytest.raises(ValueError) as err:
        MoE(H, FFN, E, 2, ep_group=ParallelMesh(ep=3).ep_group)
    return str(err.value)


def test_experts_must_split_evenly_over_ep():
    from plait.testing import run_distributed

    assert run_distributed(uneven_experts_body, 3)[0] == (
        "num_experts (4) is not divisible by the expert-parallel size ep (3); choose ep from [1, 2, 4]"
    )


@pytest.mark.parametrize(
    "bound, key",
    [(8, torch.int16), (32767, torch.int16), (40000, torch.int32), (2**40, torch.int64)],
)
def test_stable_order_with_narrow_keys_equals_the_int64_stable_sort(bound, key, monkeypatch):
    # the int16 (or, past 32767, int32) keys must give the int64 sort's order, ties in place (each id of 8
    # appears ~750 times); a key too narrow for the ids (int16 at 40000 wraps to negative) gives another
    # permutation: checked below with the int16 key forced
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, bound, (6000,), generator=g)
    want = torch.argsort(ids, stable=True)
    sorted_as, argsort = [], torch.argsort
    monkeypatch.setattr(
        torch, "argsort", lambda t, **kw: sorted_as.append(t.dtype) or argsort(t, **kw)
    )
    assert torch.equal(stable_order(ids, bound), want) and sorted_as == [
        key
    ]  # the narrow key is what sorts
    monkeypatch.undo()
    if bound > torch.iinfo(torch.int16).max:
        assert not torch.equal(torch.argsort(ids.to(torch.int16), stable=True), want)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_inverse_permutation_undoes_the_permutation(dtype):
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    inv = inverse_permutation(order)
    assert inv.dtype == dtype and torch.equal(inv, torch.argsort(order).to(dtype))
    assert torch.equal(order[inv], torch.arange(1000)) and torch.equal(
        inv[order], torch.arange(1000)
    )
