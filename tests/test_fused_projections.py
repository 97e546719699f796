"""Fused q/k/v and SwiGLU gate/up projections (``plait.layers.fused``) against the unfused computation.

Reference: the same layer code with ``fused_column_forward`` replaced by one ``F.linear`` per
projection (``unfused``, the code before the fusion). Tolerance: 1e-6 relative (l2 norm, float32).
Forward multiplies the same rows of ``x`` by the same weight rows and the weight gradient is the
same products ``dy_i^T x`` (row blocks of one GEMM); only the GEMM kernel's blocking may change the
rounding, and for the input gradient the sum over outputs is one reduction instead of 2-3 GEMMs
added: ~1e-7 relative. A fused bias's gradient ``sum_t dy_t`` may cancel (without RoPE ``k_proj.bias``'s
is zero in exact arithmetic: softmax ignores a shift shared by all keys), so its error is taken
relative to ``||sum_t |dy_t|||``, the scale of that sum's rounding error, where that is larger.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import rel_err, tiny
from plait.layers import MLP, Attention, ColumnParallelLinear, TransformerModel, fused
from plait.parallel.pipeline_backward import backward_input, backward_weight
from plait.testing import run_distributed
from plait.zero import CommOptions, ZeroOptimizer, weight_decay_groups

TOL = 1e-6


def unfused(layers, x):
    return [F.linear(x, m.weight, m.bias) for m in layers]


def swapped_kv(layers, x):
    """Deliberately wrong: the k and v slices of the fused weight trade places."""
    outs = fused.fused_column_forward(layers, x)
    return [outs[0], outs[2], outs[1]] if len(outs) == 3 else outs


@contextlib.contextmanager
def projections(fn):
    """Run attention and MLP with ``fn(layers, x)`` in place of the fused projections."""
    with mock.patch("plait.layers.attention.fused_column_forward", fn), \
            mock.patch("plait.layers.mlp.fused_column_forward", fn):
        yield


@contextlib.contextmanager
def counting():
    """Counts of fused matmul weights built (``fuse_rows``) and of copies among them (``_cat_rows``)."""
    counts = {"fused": 0, "copies": 0}

    def wrap(name, key):
        real = getattr(fused, name)
        return mock.patch.object(fused, name, lambda *a: counts.__setitem__(key, counts[key] + 1) or real(*a))
    with wrap("fuse_rows", "fused"), wrap("_cat_rows", "copies"):
        yield counts


def fill_(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return module


def grads_of(fn, x0, params, grad_out):
    """Outputs of ``fn(x)`` and the gradients of ``x`` and ``params`` for upstream ``grad_out``."""
    x = x0.clone().requires_grad_()
    for p in params:
        p.grad = None
    outs = fn(x)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    torch.autograd.backward(outs, grad_out)
    return [o.detach() for o in outs], [x.grad] + [p.grad for p in params]


# ---- the primitive ---------------------------------------------------------------------------------
def qkv_params(layout: str, bias: bool, g):
    """q ``[16, 8]``, k and v ``[8, 8]`` (GQA-like) and biases: separately allocated, or views into one
    buffer in q, k, v order ("adjacent") or v, k, q order ("reversed", ZeRO stage 0-2's packing)."""
    rows = [16, 8, 8]
    made = [[nn.Parameter(torch.randn(r, 8, generator=g)) for r in rows],
            [nn.Parameter(torch.randn(r, generator=g)) for r in rows] if bias else []]
    if layout != "separate":
        for group in made:
            place = group if layout == "adjacent" else group[::-1]
            buf, at = torch.empty(sum(p.numel() for p in group)), 0
            for p in place:
                buf[at:at + p.numel()].copy_(p.detach().reshape(-1))
                p.data = buf[at:at + p.numel()].view(p.shape)
                at += p.numel()
    return made


@pytest.mark.parametrize("layout", ["separate", "adjacent", "reversed"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_equals_separate_linears(layout, bias):
    g = torch.Generator().manual_seed(1)
    weights, biases = qkv_params(layout, bias, g)
    x0 = torch.randn(2, 5, 8, generator=g)
    grad_out = [torch.randn(2, 5, w.shape[0], generator=g) for w in weights]
    params = weights + biases
    want = grads_of(lambda x: [F.linear(x, w, b) for w, b in zip(weights, biases or [None] * 3)],
                    x0, params, grad_out)
    with counting() as counts:
        got = grads_of(lambda x: fused.fused_linear(x, weights, biases or None), x0, params, grad_out)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert a.shape == b.shape and rel_err(a, b) <= TOL
    # forward builds the fused weight (and bias), backward the weight again, always by copy, so the bits
    # do not depend on the layout: the three layouts give identical results
    assert counts["fused"] == counts["copies"] == (3 if bias else 2)
    g = torch.Generator().manual_seed(1)
    others = qkv_params("separate", bias, g)
    assert all(torch.equal(a, b) for a, b in zip(weights + biases, others[0] + others[1]))
    again = grads_of(lambda x: fused.fused_linear(x, others[0], others[1] or None), x0, others[0] + others[1],
                     grad_out)
    assert all(torch.equal(a, b) for a, b in zip(got[0] + got[1], again[0] + again[1]))


def test_meta_and_fake_tensors_fuse_too():
    """Shape inference and memory planning (meta, fake tensors): the same shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = [torch.empty(16, 8, device="meta"), torch.empty(8, 8, device="meta")]
    assert [t.shape for t in fused.fused_linear(torch.empty(2, 5, 8, device="meta"), meta)] == [(2, 5, 16), (2, 5, 8)]
    with FakeTensorMode():
        buf = torch.empty(24, 8)
        fake = [buf[:16], buf[16:]]
        assert [t.shape for t in fused.fused_linear(torch.empty(2, 5, 8), fake)] == [(2, 5, 16), (2, 5, 8)]


def test_fused_column_forward_refuses_layers_it_cannot_fuse():
    a, b = ColumnParallelLinear(8, 4), ColumnParallelLinear(8, 4, bias=False)
    with pytest.raises(ValueError, match="all have a bias or none"):
        fused.fused_column_forward([a, b], torch.zeros(1, 1, 8))
    with pytest.raises(ValueError, match="gather_output"):
        fused.fused_column_forward([a, ColumnParallelLinear(8, 4, gather_output=True)], torch.zeros(1, 1, 8))


# ---- the layers at tp 1, 2, 4 -------------------------------------------------------------------
LAYERS = {  # name -> (constructor kwargs); hidden 32, 8 tokens
    "mha_bias": dict(kind="attn", num_heads=4, num_kv_heads=4, bias=True),
    "gqa_rope": dict(kind="attn", num_heads=8, num_kv_heads=4, head_dim=4, rope_theta=10000.0),
    "gqa_rope_bias": dict(kind="attn", num_heads=8, num_kv_heads=4, head_dim=4, rope_theta=10000.0, bias=True),
    "swiglu": dict(kind="mlp", bias=False),
    "swiglu_bias": dict(kind="mlp", bias=True),
}


def recording(fn, scales: dict):
    """``fn`` that also records, per fused bias, ``||sum_t |dy_t|||`` over the tokens ``t`` of its
    projection's output gradient: the scale of the rounding error of that bias's gradient."""
    def run(layers, x):
        outs = fn(layers, x)
        for m, out in zip(layers, outs):
            if m.bias is not None:
                out.register_hook(lambda g, b=m.bias: scales.__setitem__(
                    id(b), float(g.abs().flatten(0, -2).sum(0).norm())))
        return outs
    return run


def make_layer(name: str, group, sequence_parallel: bool, seed: int) -> nn.Module:
    kw = dict(LAYERS[name])
    if kw.pop("kind") == "mlp":
        layer = MLP(32, 64, "swiglu", group=group, sequence_parallel=sequence_parallel, **kw)
    else:
        layer = Attention(32, group=group, sequence_parallel=sequence_parallel, **kw)
    return fill_(layer, seed)


def layer_errors(sequence_parallel: bool, mesh=None, projection=fused.fused_column_forward) -> dict:
    """Per layer, the relative error of ``projection`` against ``unfused`` on this rank, for the
    output and every parameter and input gradient (``mesh``: a ``ParallelMesh``, None for tp 1)."""
    group, rank, tp = (None, 0, 1) if mesh is None else (mesh.tp_group, mesh.tp_rank, mesh.tp)
    g = torch.Generator().manual_seed(5)
    x0, grad_out = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g)
    if sequence_parallel:   # this rank's sequence shard
        x0, grad_out = x0.chunk(tp, dim=1)[rank], grad_out.chunk(tp, dim=1)[rank]
    out = {}
    for name in LAYERS:
        layer = make_layer(name, group, sequence_parallel, seed=100 + rank)
        names, params = zip(*layer.named_parameters())
        runs, scales = [], {}
        for fn in (projection, recording(unfused, scales)):
            with projections(fn):
                runs.append(grads_of(layer, x0, list(params), [grad_out]))
        (y, gs), (y_ref, gs_ref) = runs
        errs = {"output": rel_err(y[0], y_ref[0]), "input": rel_err(gs[0], gs_ref[0])}
        for n, p, a, b in zip(names, params, gs[1:], gs_ref[1:]):
            errs[n] = rel_err(a, b, floor=scales.get(id(p), 0.0))
        out[name] = errs
    return out


def assert_close_everywhere(per_rank: list, what: str):
    for rank, errs in enumerate(per_rank):
        for layer, e in errs.items():
            worst = max(e, key=e.get)
            assert e[worst] <= TOL, f"{what} rank {rank} {layer}: {worst} off by {e[worst]:.2e}"


def _tp_body(tp: int):
    from plait.parallel import ParallelMesh

    mesh = ParallelMesh(tp=tp)
    return {sp: layer_errors(sp, mesh) for sp in (False, True)}


def test_layers_equal_unfused_at_tp1():
    assert_close_everywhere([layer_errors(False)], "tp=1")


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_equal_unfused_under_tensor_and_sequence_parallelism(tp):
    """Each rank holds its heads' (and ffn columns') slices; with sequence parallelism the input is
    the rank's sequence shard, all-gathered once before the fused matmul."""
    per_rank = run_distributed(_tp_body, tp, tp, timeout_s=120)
    for sp in (False, True):
        assert_close_everywhere([r[sp] for r in per_rank], f"tp={tp} sp={sp}")


def test_swapped_kv_slices_are_caught():
    """The check can fail: swapping the k and v slices moves every attention output far past 1e-6."""
    errs = layer_errors(False, projection=swapped_kv)
    for name in ("mha_bias", "gqa_rope", "gqa_rope_bias"):
        assert errs[name]["output"] > 1e-2, (name, errs[name]["output"])


# ---- under ZeRO: the flat buffers make the fused weight a view ------------------------------------
def train_zero(stage: int, persist: int, projection, steps: int = 3):
    """A Llama-tiny with biases (GQA, SwiGLU) trained ``steps`` SGD steps under ZeroOptimizer on one
    process, with the engine's weight-decay param groups and stage-3 units; returns the whole weights
    and the ``counting`` of fused weights built and copied. SGD, not Adam: Adam divides by sqrt(v), so
    rounding noise in a near-zero gradient (``k_proj.bias``) moves a weight by up to ~lr, hiding
    what is compared here; SGD moves each weight by lr times its gradient."""
    from helpers import micro_batch
    from plait.engine_model import stage3_units

    model = TransformerModel(tiny("llama", bias=True), seed=3)
    opt = ZeroOptimizer(model, None, stage=stage, optimizer=torch.optim.SGD,
                        optimizer_kwargs=dict(lr=0.1, momentum=0.9),
                        param_groups=weight_decay_groups(model, 0.1),
                        units=stage3_units(model) if stage == 3 else None,
                        comm=CommOptions(param_persistence_threshold=persist))
    with projections(projection), counting() as counts:
        for step in range(steps):
            opt.backward(model(**micro_batch(step, 0, 0)))
            assert opt.step()
    with opt.gathered_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}, counts


@pytest.mark.parametrize("stage, persist", [(2, 100_000), (3, 0), (3, 100_000)])
def test_zero_training_equals_unfused(stage, persist):
    """Stage 2 packs each param group in reverse registration order, stage 3 a unit's sharded parameters
    in registration order and persistent ones in reverse order: training equals the unfused layers'."""
    got, counts = train_zero(stage, persist, fused.fused_column_forward)
    want, _ = train_zero(stage, persist, unfused)
    assert counts["fused"] > 0, counts
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=TOL, atol=TOL * float(w.abs().max()), msg=name)


# ---- the zero-bubble split and torch.compile -------------------------------------------------------
def test_zero_bubble_input_pass_leaves_the_weight_gemm_to_the_weight_pass():
    """``plait.parallel.pipeline_backward``: BI runs the fused node for ``dx`` only (no ``dW``, no bias
    sum); BW computes them from the saved tensors, without an engine call; bitwise the plain backward."""
    model = TransformerModel(tiny("llama", bias=True), layers=range(1, 3), seed=3)
    g = torch.Generator().manual_seed(2)
    x0, grad_out = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g)
    params = list(model.parameters())
    _, want = grads_of(lambda x: model(hidden=x), x0, params, [grad_out])
    for p in params:
        p.grad = None
    wants, real = [], fused.param_grads
    x = x0.clone().requires_grad_()
    with mock.patch.object(fused, "param_grads", lambda *a: wants.append(list(a[-1])) or real(*a)):
        gx, pending = backward_input(model(hidden=x), grad_out, x)
        assert pending.split and len(wants) == 4 and not any(any(w) for w in wants)   # 2 blocks x (qkv, gate/up)
        wants.clear()
        backward_weight(pending)
        assert len(wants) == 4 and all(all(w) for w in wants)
    for a, b in zip([gx] + [p.grad for p in params], want):
        assert torch.equal(a, b)


def test_compiles_without_graph_breaks():
    """Under torch.compile the fused weight is always a ``torch.cat`` (no pointer checks to trace):
    one graph, and (aot_eager) the eager numbers."""
    layer = make_layer("gqa_rope_bias", None, False, seed=1)
    x0 = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    explained = torch._dynamo.explain(layer)(x0)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    params = list(layer.parameters())
    grad_out = [torch.ones(2, 8, 32)]
    want = grads_of(layer, x0, params, grad_out)
    got = grads_of(torch.compile(layer, backend="aot_eager"), x0, params, grad_out)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert rel_err(a, b) <= TOL
