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


@pytest.mark.parametrize("order, normalize, capacity_factor, shared", [
    ("softmax_topk", True, None, 0), ("softmax_topk", False, None, 12), ("topk_softmax", True, None, 0),
    ("softmax_topk", True, 0.75, 0)])
def test_moe_matches_the_token_by_token_reference(order, normalize, capacity_factor, shared):
    """Dropless and capacity (0.75: a quarter of the assignments dropped), with and without shared experts."""
    moe = layer(router_order=order, normalize_topk=normalize, capacity_factor=capacity_factor,
                shared_ffn_hidden_size=shared)
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
    routed = torch.bincount(torch.topk(probs if order == "softmax_topk" else logits, 2).indices.reshape(-1),
                            minlength=E)
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
    balanced = torch.full((T, E), 0.0, dtype=torch.float64)          # uniform probs, even routing: loss = k
    even = torch.arange(T * 2).remainder(E).view(T, 2)
    assert balance_loss(balanced.softmax(-1), even).item() == pytest.approx(2.0)
    moe = layer(balance_loss_coef=0.1, z_loss_coef=0.01)
    _, aux = moe(tokens())
    assert aux.loss.item() == pytest.approx(0.1 * aux.balance.item() + 0.01 * aux.z.item(), rel=1e-6)


def test_grouped_gemm_equals_a_matmul_per_expert():
    """``grouped_mm`` (torch._grouped_mm on aligned sizes, an empty expert included) against a loop."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(10, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    counts = torch.tensor([4, 0, 6])
    want = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    assert torch.allclose(grouped_mm(x, w, counts), want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(grouped_mm(x, w, counts, grouped=False), want, rtol=1e-6, atol=1e-6)
    x6, w6 = x[:, :6].contiguous(), w[..., :6].contiguous()       # 24-byte rows: the per-expert fallback
    assert torch.allclose(grouped_mm(x6, w6, counts), torch.cat([x6[:4] @ w6[0].T, x6[4:] @ w6[2].T]), atol=1e-6)


def test_dispatch_keeps_token_order_within_experts_and_the_capacity():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    slots, rows, dropped = dispatch(experts, 3, None)
    assert slots.tolist() == [0, 2, 4, 7, 1, 5, 6, 3] and rows.tolist() == [4, 3, 1] and int(dropped) == 0
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
    y, _ = moe(x)                     # the reference adds the same bias to its selection scores only
    assert rel_err(y, reference(moe, x, "softmax_topk", True)[0]) <= 1e-5


def test_bad_arguments_name_the_numbers():
    with pytest.raises(ValueError, match=r"top_k=5 must lie in \[1, num_experts=4\]"):
        MoE(H, FFN, E, 5)
    with pytest.raises(ValueError, match="unknown router_order 'sigmoid'"):
        MoE(H, FFN, E, 2, router_order="sigmoid")
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(H, FFN, E, 2, capacity_factor=0.0)


# ---- in a model: every block's MLP a mixture of experts ---------------------------------------------------
def moe_tiny():
    """test_engine's Llama with 4 experts of width 48, top-2, a z-loss too."""
    from test_engine import tiny
    return tiny(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48, moe_z_loss_coef=1e-3)


def test_model_loss_adds_every_blocks_expert_losses():
    """Loss with labels = cross entropy of the logits + each block's weighted balance and z losses."""
    from plait.layers import TransformerModel
    from test_engine import micro_batch
    model = TransformerModel(moe_tiny(), None, seed=5)
    batch = micro_batch(0, 0, 0)
    seen = []
    for block in (m for m in model.modules() if isinstance(m, MoE)):
        block.register_forward_hook(lambda mod, args, out: seen.append(out[1].loss))
    loss = model(**batch)
    aux = sum(seen)
    assert len(seen) == 2 and aux.item() > 0.01   # balance ~ top_k = 2 at coefficient 0.01
    logits = model(input_ids=batch["input_ids"])
    ce = F.cross_entropy(logits[..., :1001].flatten(0, 1).float(), batch["labels"].flatten())   # vocab unpadded
    assert loss.item() == pytest.approx(ce.item() + aux.item(), rel=1e-6)


def engine_moe_body(tp):
    import torch.distributed as dist

    import plait
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh
    from plait.parallel.sharding import gather_logical_state
    from test_engine import GAS, STEPS, ds_config, micro_batch
    results = {}
    for stage in (1, 2, 3):
        mesh = ParallelMesh(tp=tp)
        model = TransformerModel(moe_tiny(), mesh, seed=5)
        engine = plait.initialize(model, ds_config(stage, tp), mesh=mesh)
        losses = [engine.train_batch(iter([micro_batch(s, g, mesh.dp_rank) for g in range(GAS)])).item()
                  for s in range(STEPS)]
        with engine.optimizer.gathered_parameters():
            whole = {n: t.float().cpu() for n, t in gather_logical_state(model, mesh.tp_group).items()}
        results[stage] = (whole, losses, engine.global_steps, engine.get_lr()[0])
    return results if dist.get_rank() == 0 else None


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_trains_a_mixture_of_experts_model_as_one_process(tp):
    """5 AdamW steps through ``plait.initialize`` over 2 ranks (dp 2, or tp 2 with the experts whole on both),
    ZeRO-1/2/3, against one process: losses to 1e-5 and every weight to 3e-6 (test_engine's 1e-6 x 3). The
    router adds a path from every block's balance and z losses into the embedding, whose rare tokens' rows
    get gradients near 0 that Adam scales up with their rounding: the word embedding is the worst weight,
    measured at 4e-7 with AVX-512 kernels and 8.5e-7 to 1.4e-6 with AVX2 ones (two runs on an AMD EPYC, the
    second in CI's fresh environment); every other weight stays under 2e-7. A layout mistake, such as dp 2
    against the one-rank batch, is off by orders of magnitude more."""
    from plait.testing import run_distributed
    from test_engine import reference
    dp = 2 // tp
    ref_weights, ref_losses = reference(dp, moe_tiny())
    for stage, (whole, losses, steps, _) in run_distributed(engine_moe_body, 2, tp)[0].items():
        assert steps == 5 and losses == pytest.approx(ref_losses, rel=1e-5), f"stage {stage} loss curve"
        for name, ref in ref_weights.items():
            err = rel_err(whole[name], ref, floor=1e-12)
            assert err <= 3e-6, f"ZeRO-{stage} tp={tp} dp={dp}: {name} off by {err:.2e}"


def test_unsupported_layouts_are_refused():
    from plait.layers.stages import build_stage_modules
    with pytest.raises(ValueError, match="num_experts > 0 with pipeline parallelism is not supported yet"):
        build_stage_modules(moe_tiny(), None, v=2)
    with pytest.raises(ValueError, match=r"num_experts \(4\) must be >= 0 .* moe_top_k \(5\)"):
        moe_tiny().replace(moe_top_k=5)


def test_recomputed_blocks_give_the_same_loss_and_gradients():
    """Activation checkpointing of every block (the experts' losses come from the first forward; the
    recomputation in backward appends again to a list the head has already used)."""
    from plait.layers import TransformerModel
    from test_engine import micro_batch
    results = []
    for recompute in (None, "full"):
        model = TransformerModel(moe_tiny(), None, seed=5, recompute=recompute)
        loss = model(**micro_batch(0, 0, 0))
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    assert results[1][0] == results[0][0]
    for name, grad in results[0][1].items():
        assert rel_err(results[1][1][name], grad) <= 1e-6, name
