"""The zero-bubble backward split (BI + BW) on its own: bitwise the plain backward, without
per-node engine calls for plait's layers, with AccumulateGrad hooks firing in BW only."""

import pytest
import torch
import torch.nn.functional as F

from plait.layers import TransformerModel
from plait.models import preset
from plait.layers.norm import _RMSNormWeight
from plait.parallel.pipeline.backward import backward_input, backward_weight
from plait.parallel.pipeline.weight_grad import plan
from plait.testing import run_distributed


def split_vs_plain(fn, x0, params, grad_out=None):
    """(plain grads, split grads, per-node engine calls in BW) of ``fn(x)`` w.r.t. x and params."""
    x = x0.clone().requires_grad_()
    out = fn(x)
    torch.autograd.backward(out, grad_out)
    want = [x.grad] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    x = x0.clone().requires_grad_()
    gx, pending = backward_input(fn(x), grad_out, x)
    assert pending.split and all(p.grad is None for p in params)
    calls = [0]
    grad = torch.autograd.grad

    def counting(*a, **k):
        calls[0] += 1
        return grad(*a, **k)

    torch.autograd.grad = counting
    try:
        backward_weight(pending)
    finally:
        torch.autograd.grad = grad
    got = [gx] + [p.grad for p in params]
    for p in params:
        p.grad = None
    return want, got, calls[0]


def assert_bitwise(want, got):
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), (i, (a - b).abs().max().item())


@pytest.mark.parametrize(
    "case",
    [
        "linear",
        "linear_bias",
        "mat1_side",
        "row_major_mat2",
        "addmm_scaled",
        "mul_broadcast",
        "add_alpha",
        "layer_norm",
        "layer_norm_weight_only",
        "rms_norm",
    ],
)
def test_weight_grads_bitwise_equal_engine(case):
    """Each covered node type, alone: direct formula == the node run by the engine (BW's old path)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g, requires_grad=True)
    b = torch.randn(6, generator=g, requires_grad=True)
    v = torch.randn(5, generator=g, requires_grad=True)
    x0 = torch.randn(3, 4, 5, generator=g)
    fns = {
        "linear": (lambda x: torch.tanh(F.linear(x, w)), [w]),
        "linear_bias": (lambda x: torch.tanh(F.linear(x, w, b)), [w, b]),
        "mat1_side": (lambda x: torch.tanh(w.mm(x[0].t())), [w]),  # weight as mat1
        "row_major_mat2": (lambda x: torch.tanh(x[0] @ w.t().contiguous()), [w]),
        "addmm_scaled": (
            lambda x: torch.tanh(torch.addmm(b, x[0], w.t(), beta=0.5, alpha=2.0)),
            [w, b],
        ),
        "mul_broadcast": (lambda x: torch.tanh(x * v), [v]),
        "add_alpha": (lambda x: torch.tanh(torch.add(x, v, alpha=3.0)), [v]),
        "layer_norm": (lambda x: torch.tanh(F.layer_norm(x, (5,), v, b[:5])), [v]),
        "layer_norm_weight_only": (lambda x: torch.tanh(F.layer_norm(x, (5,), v)), [v]),
        "rms_norm": (
            lambda x: torch.tanh(_RMSNormWeight.apply(x, v, 1e-6)),
            [v],
        ),  # a custom Function
    }
    fn, params = fns[case]
    out_shape = fn(x0).shape
    want, got, calls = split_vs_plain(fn, x0, params, torch.randn(out_shape, generator=g))
    assert calls == 0, f"{case}: BW ran {calls} per-node engine calls"
    assert_bitwise(want, got)


def test_nodes_without_a_formula_get_their_weight_gradient_in_bi():
    """A weight node type without a formula here (``plan`` returns None) is not deferred: BI computes its
    parameter gradient with the input gradient, BW only feeds it into ``.grad`` (no per-node engine call),
    exactly the plain backward's value."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 5, 5, generator=g, requires_grad=True)
    x0 = torch.randn(3, 4, 5, generator=g)
    fn = lambda x: torch.tanh(torch.bmm(x, w)).sum()  # noqa: E731 (BmmBackward0: not covered)
    x = x0.clone().requires_grad_()
    node = torch.bmm(x, w).grad_fn
    assert plan(node, [(1, node.next_functions[1][0], 0)]) is None
    _, pending = backward_input(fn(x), None, x)
    assert pending.nodes == [] and len(pending.ready) == 1 and w.grad is None
    want, got, calls = split_vs_plain(fn, x0, [w])
    assert calls == 0
    assert_bitwise(want, got)


def model_case(arch, dtype, head):
    cfg = preset(f"{arch}-tiny", num_layers=3, hidden_dropout=0.0, attention_dropout=0.0)
    layers = range(1, 5) if head else range(1, 4)
    model = TransformerModel(cfg, layers=layers, seed=3, dtype=dtype)
    g = torch.Generator().manual_seed(4)
    batch = {"labels": torch.randint(0, 8000, (2, 12), generator=g)} if head else {}
    x0 = torch.randn(2, 12, cfg.hidden_size, generator=g).to(dtype)
    grad_out = None if head else torch.randn(2, 12, cfg.hidden_size, generator=g).to(dtype)
    return model, (lambda x: model(hidden=x, **batch)), x0, grad_out


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", [False, True])
def test_plait_blocks_split_bitwise_without_engine_calls(arch, dtype, head):
    """Real plait stages (middle: blocks; last: blocks + head): BI + BW == one plain backward,
    bitwise, and every weight node of these layers is covered (no per-node engine call)."""
    model, fn, x0, grad_out = model_case(arch, dtype, head)
    want, got, calls = split_vs_plain(fn, x0, list(model.parameters()), grad_out)
    assert calls == 0
    assert_bitwise(want, got)


def test_post_accumulate_grad_hooks_fire_in_bw_only():
    """ZeRO-2/3 reduce gradients from post-accumulate-grad hooks: none may fire in BI, each
    parameter's exactly once in BW, with ``.grad`` final."""
    model, fn, x0, grad_out = model_case("llama", torch.float32, False)
    fired = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda p: fired.append((id(p), p.grad.clone())))
        for p in model.parameters()
    ]
    try:
        x = x0.clone().requires_grad_()
        _, pending = backward_input(fn(x), grad_out, x)
        assert fired == []
        backward_weight(pending)
        assert sorted(i for i, _ in fired) == sorted(id(p) for p in model.parameters())
        for p in model.parameters():
            (seen,) = [g for i, g in fired if i == id(p)]
            assert torch.equal(seen, p.grad)
    finally:
        for h in handles:
            h.remove()


def _sp_body(arch):
    from plait.parallel import ParallelMesh

    mesh = ParallelMesh(tp=2, pp=1, dp=1)
    cfg = preset(f"{arch}-tiny", num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    model = TransformerModel(cfg, mesh, sequence_parallel=True, layers=range(1, 4), seed=3)
    g = torch.Generator().manual_seed(7)
    batch = {"labels": torch.randint(0, 8000, (2, 12), generator=g)}
    x0 = torch.randn(2, 6, cfg.hidden_size, generator=g)  # this rank's sequence shard
    want, got, calls = split_vs_plain(
        lambda x: model(hidden=x, **batch), x0, list(model.parameters())
    )
    assert calls == 0
    assert_bitwise(want, got)
    return True


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_split_under_tp2_sequence_parallel(arch):
    """tp=2 with sequence parallelism (copy_to_tp on the norm weights: their all-reduce runs in
    BW's tail call): bitwise the plain backward on both ranks."""
    assert run_distributed(_sp_body, 2, arch, timeout_s=120) == [True, True]


def test_checkpointed_blocks_recompute_once_per_pass():
    """recompute="full": BI + BW is still bitwise the plain backward, and each block's forward is
    replayed once in BI and once in BW (not once per weight node)."""
    cfg = preset("llama-tiny", num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    model = TransformerModel(cfg, layers=range(1, 3), seed=3, recompute="full")
    calls = []
    for i in (1, 2):
        model.layers[str(i)].mlp.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    g = torch.Generator().manual_seed(5)
    x0, grad_out = (
        torch.randn(2, 12, cfg.hidden_size, generator=g),
        torch.randn(2, 12, cfg.hidden_size, generator=g),
    )
    want, got, engine_calls = split_vs_plain(
        lambda x: model(hidden=x), x0, list(model.parameters()), grad_out
    )
    assert engine_calls == 0
    assert_bitwise(want, got)
    # plain: forward + recompute per block; split: forward + recompute in BI + recompute in BW
    assert sorted(calls) == [1] * 5 + [2] * 5, calls


def _saved_tensor_alive(node) -> bool:
    try:
        node._saved_self
        return True
    except RuntimeError:  # "Trying to backward through the graph a second time": released
        return False


def test_bi_frees_activations_that_bw_does_not_need():
    """With plain saved tensors, BI does not retain the graph: e.g. the SiLU of SwiGLU (not a
    weight node) has released its input after BI; BW still gives the plain backward, bitwise."""
    model, fn, x0, grad_out = model_case("llama", torch.float32, False)
    want, _, _ = split_vs_plain(fn, x0, list(model.parameters()), grad_out)
    x = x0.clone().requires_grad_()
    out = fn(x)
    silu, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        silu += [node] if type(node).__name__ == "SiluBackward0" else []
        stack += [c for c, _ in node.next_functions if c is not None]
    assert silu and all(_saved_tensor_alive(n) for n in silu)
    gx, pending = backward_input(out, grad_out, x)
    assert not any(_saved_tensor_alive(n) for n in silu)
    backward_weight(pending)
    assert_bitwise(want, [gx] + [p.grad for p in model.parameters()])


def test_saved_tensor_hooks_keep_the_graph_and_stay_exact():
    """Saved-tensor hooks (offload-style pack/unpack): the formulas read the tensors in BW (the
    graph is retained) and unpack through the hooks; still bitwise the plain backward."""
    model, fn, x0, grad_out = model_case("gpt2", torch.float32, False)
    unpacked = [0]

    def unpack(t):
        unpacked[0] += 1
        return t

    def hooked(x):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            return fn(x)

    want, got, calls = split_vs_plain(hooked, x0, list(model.parameters()), grad_out)
    assert calls == 0 and unpacked[0] > 0
    assert_bitwise(want, got)
