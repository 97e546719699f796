"""The fused head + loss (plait.layers.fused_cross_entropy) against the unfused head
(``F.linear`` + ``vocab_parallel_cross_entropy``): the per-token loss and the gradients of the hidden
states, the weight and the bias, at tp 1, 2 and 4 (gloo), with and without sequence parallelism, with
ignored tokens, label smoothing 0 and 0.1, a padded vocabulary (301 over tp * 16), a chunk of 7 tokens
that does not divide the 36 tokens, a head bias, and a mean or a token-weighted sum of the losses.

Tolerance TOL = 1e-6 relative (``rel_err``, l2 over the tensor): both paths run the same float32
math on the same logits rows (the shared ``block_statistics`` and ``logits_gradient_``); they differ
only in summation order (weight and bias gradients summed chunk by chunk, the loss gradient applied
after the matmuls instead of before), a few float32 roundings (~1e-7) relative to values of order 1.
The whole-model checks hold every parameter gradient to the same 1e-6 (worst seen: 8e-7, BERT's
LayerNorm weights, whose gradients are sums over tokens that partly cancel, so the head's rounding
differences grow relative to them). Both paths are also held to 1e-5 against an independent float64
whole-vocabulary reference (``F.cross_entropy``), the float32-vs-float64 tolerance of
test_tp_parity.py. The broken variants show a wrong gradient term or mask misses TOL by orders of
magnitude, so the parity can fail.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import micro_batch, rel_err, tiny

import plait.layers.fused_cross_entropy as fce
from plait.layers import (
    TransformerConfig,
    TransformerModel,
    fused_linear_cross_entropy,
    padded_vocab_size,
)
from plait.layers.cross_entropy import (
    block_statistics,
    logits_gradient_,
    vocab_parallel_cross_entropy,
)
from plait.layers.linear import enter_tp_region
from plait.layers.stages import build_stage_modules
from plait.parallel import ParallelMesh
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.parallel.pipeline.backward import backward_input, backward_weight
from plait.testing import run_distributed

TOL, REF_TOL = 1e-6, 1e-5
V, H, B, S, ALIGN, CHUNK, IGNORE = 301, 16, 3, 12, 16, 7, -100
NAMES = ("loss", "hidden", "weight", "bias")


def make_inputs(tp: int):
    """Whole hidden ``[B, S, H]``, weight ``[V_pad, H]`` (padded rows nonzero: only the mask hides
    them), bias ``[V_pad]``, target ``[B, S]`` with ignored tokens and the last real id."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(padded_vocab_size(V, tp, ALIGN), H, generator=g) * 0.5
    bias = torch.randn(weight.shape[0], generator=g) * 0.1
    target = torch.randint(0, V, (B, S), generator=g)
    target[0, :4] = IGNORE
    target[2, 5] = IGNORE
    target[1, 0] = V - 1
    return hidden, weight, bias, target, torch.rand(B, S, generator=g)


def reduce_losses(losses, target, token_weight):
    """The head's mean over kept tokens, or a token-weighted sum (backward's recomputation path)."""
    if token_weight is None:
        return losses.sum() / (target != IGNORE).sum()
    return (losses * token_weight).sum()


def run_head(fused: bool, inputs, tp, rank, group, sp, smoothing, use_bias, weighted):
    """This rank's per-token loss and gradients (hidden leaf: its sequence shard under sp)."""
    hidden, weight, bias, target, token_weight = inputs
    leaf = (hidden.chunk(tp, 1)[rank] if sp else hidden).clone().requires_grad_()
    w = weight.chunk(tp, 0)[rank].clone().requires_grad_()
    b = bias.chunk(tp, 0)[rank].clone().requires_grad_() if use_bias else None
    x = enter_tp_region(leaf, group, sp)
    kw = dict(vocab_size=V, vocab_start=rank * w.shape[0], group=group, label_smoothing=smoothing)
    if fused:
        losses = fused_linear_cross_entropy(x, w, b, target, chunk_tokens=CHUNK, **kw)
    else:
        losses = vocab_parallel_cross_entropy(F.linear(x, w, b), target, **kw)
    reduce_losses(losses, target, token_weight if weighted else None).backward()
    return [losses.detach(), leaf.grad, w.grad] + ([b.grad] if use_bias else [])


def reference(inputs, tp, rank, sp, smoothing, use_bias, weighted):
    """Float64 whole-vocabulary torch cross entropy; this rank's slices of its gradients."""
    hidden, weight, bias, target, token_weight = inputs
    leaf, w, b = (t.double().requires_grad_() for t in (hidden, weight, bias))
    logits = F.linear(leaf, w[:V], b[:V] if use_bias else None)
    losses = F.cross_entropy(
        logits.reshape(-1, V),
        target.reshape(-1),
        ignore_index=IGNORE,
        label_smoothing=smoothing,
        reduction="none",
    ).reshape(target.shape)
    reduce_losses(losses, target, token_weight.double() if weighted else None).backward()
    grads = [leaf.grad.chunk(tp, 1)[rank] if sp else leaf.grad, w.grad.chunk(tp, 0)[rank]]
    return [losses.detach()] + grads + ([b.grad.chunk(tp, 0)[rank]] if use_bias else [])


def parity_body(tp: int, sps):
    """Every combination on this rank; returns (fused losses per case, worst errors)."""
    group = dist.group.WORLD if tp > 1 else None
    rank = dist.get_rank() if tp > 1 else 0
    inputs = make_inputs(tp)
    losses, worst, worst_ref = [], 0.0, 0.0
    for case in itertools.product(sps, (0.0, 0.1), (True, False), (False, True)):
        fused = run_head(True, inputs, tp, rank, group, *case)
        plain = run_head(False, inputs, tp, rank, group, *case)
        ref = reference(inputs, tp, rank, *case)
        for name, a, p, r in zip(NAMES, fused, plain, ref):
            err, err_ref = rel_err(a, p), max(rel_err(a, r), rel_err(p, r))
            assert err <= TOL, f"{name} of {case} at tp={tp}: fused vs unfused {err:.2e}"
            assert err_ref <= REF_TOL, (
                f"{name} of {case} at tp={tp}: vs float64 reference {err_ref:.2e}"
            )
            worst, worst_ref = max(worst, err), max(worst_ref, err_ref)
        losses.append(fused[0])
    return losses, worst, worst_ref


def test_parity_tp1():
    _, worst, worst_ref = parity_body(1, (False,))
    assert worst <= TOL and worst_ref <= REF_TOL


@pytest.mark.parametrize("tp", [2, 4])
def test_parity_tensor_parallel(tp):
    """Sequence parallelism off and on; the per-token losses are bitwise identical on every rank."""
    results = run_distributed(parity_body, tp, tp, (False, True), timeout_s=120)
    for losses, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(losses, results[0][0]))


def _without_eps_term(softmax, idx, in_block, valid, smoothing, vocab_size):
    softmax.scatter_add_(-1, idx, -((1.0 - smoothing) * in_block.float()).unsqueeze(-1))
    return softmax


def _without_padded_mask_in_gradient(softmax, idx, in_block, valid, smoothing, vocab_size):
    return logits_gradient_(softmax, idx, in_block, torch.ones_like(valid), smoothing, vocab_size)


def _without_padded_mask_in_loss(logits, target, vocab_size, *rest):
    return block_statistics(logits, target, 10**9, *rest)


@pytest.mark.parametrize(
    "name, fn",
    [
        ("logits_gradient_", _without_eps_term),
        ("logits_gradient_", _without_padded_mask_in_gradient),
        ("block_statistics", _without_padded_mask_in_loss),
    ],
)
def test_broken_variant_fails_the_tolerance(monkeypatch, name, fn):
    """The correct fused head passes TOL; one missing term or mask misses it by > 100x."""
    inputs = make_inputs(1)
    case = (False, 0.1, True, False)  # no sp, label smoothing 0.1, bias, mean loss
    plain = run_head(False, inputs, 1, 0, None, *case)
    good = run_head(True, inputs, 1, 0, None, *case)
    assert max(rel_err(a, p) for a, p in zip(good, plain)) <= TOL
    monkeypatch.setattr(fce, name, fn)
    broken = run_head(True, inputs, 1, 0, None, *case)
    assert max(rel_err(a, p) for a, p in zip(broken, plain)) > 100 * TOL


def compare_models(cfg: TransformerConfig, mesh=None, sp=False, layers=None, hidden=None) -> float:
    """Worst relative difference (loss, stage-input grad, every parameter grad) of ``cfg`` with the
    fused loss (chunk 5) against the unfused one, same seed and batch."""
    batch = micro_batch(0, 0, 0, vocab_size=cfg.vocab_size, seq=8)
    batch["labels"] = batch["labels"].clone()  # a view of input_ids
    batch["labels"][0, :3] = IGNORE
    results = []
    for chunk in (5, 0):
        model = TransformerModel(
            cfg.replace(fused_loss_chunk_tokens=chunk),
            mesh,
            sequence_parallel=sp,
            layers=layers,
            seed=3,
        )
        x = None if hidden is None else hidden.clone().requires_grad_()
        loss = model(**batch) if x is None else model(hidden=x, labels=batch["labels"])
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((loss.detach(), None if x is None else x.grad, grads))
    (loss_f, x_f, g_f), (loss_p, x_p, g_p) = results
    errs = [rel_err(loss_f, loss_p)] + ([] if x_f is None else [rel_err(x_f, x_p)])
    errs += [rel_err(g_f[n], g_p[n], floor=1e-3) for n in g_p]
    return max(errs)


@pytest.mark.parametrize(
    "arch, overrides",
    [("gpt2", {}), ("llama", dict(tie_embeddings=False, label_smoothing=0.1)), ("bert", {})],
)
def test_model_switch_same_loss_and_grads(arch, overrides):
    """GPT-2 (tied), Llama (untied, label smoothing), BERT (dense transform, head bias), one process."""
    assert compare_models(tiny(arch, **overrides)) <= TOL


def _model_tp_body():
    mesh = ParallelMesh(tp=2)
    return [
        compare_models(tiny(arch, label_smoothing=0.1), mesh, sp=True)
        for arch in ("gpt2", "llama", "bert")
    ]


def test_model_switch_tp2_sequence_parallel():
    for worst in run_distributed(_model_tp_body, 2, timeout_s=120):
        assert max(worst) <= TOL


def test_pipeline_last_stage_and_zero_bubble_split():
    """A last pipeline stage (blocks + head holding a tied copy of the embedding): fused == unfused;
    the zero-bubble split (BI, then BW running the fused node again) is bitwise a plain backward."""
    cfg = tiny("gpt2")
    hidden = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    assert compare_models(cfg, layers=range(2, 4), hidden=hidden) <= TOL
    model = TransformerModel(cfg.replace(fused_loss_chunk_tokens=5), layers=range(2, 4), seed=3)
    labels = micro_batch(0, 0, 0, vocab_size=cfg.vocab_size, seq=8)["labels"]
    x = hidden.clone().requires_grad_()
    model(hidden=x, labels=labels).backward()
    want = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x = hidden.clone().requires_grad_()
    gx, pending = backward_input(model(hidden=x, labels=labels), None, x)
    assert pending.split and all(p.grad is None for p in model.parameters())
    backward_weight(pending)
    got = [gx] + [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def _pipeline_body():
    """pp=2 x tp=2 with sequence parallelism: the whole pipeline step with the fused loss on the last
    stage against the unfused one (GPT-2 tied across stages with zb-h1, Llama with 1f1b)."""
    mesh, worst = ParallelMesh(tp=2, pp=2), 0.0
    for arch, schedule in (("gpt2", "zb-h1"), ("llama", "1f1b")):
        cfg = tiny(arch, label_smoothing=0.1)
        batches = [micro_batch(0, j, 0, vocab_size=cfg.vocab_size, seq=8) for j in range(4)]
        runs = []
        for chunk in (5, 0):
            chunks = build_stage_modules(
                cfg.replace(fused_loss_chunk_tokens=chunk), mesh, sequence_parallel=True, seed=3
            )
            pipe = PipelineParallel(chunks, mesh, schedule=schedule, micro_batches=4)
            runs.append(
                (pipe.train_batch(iter(batches)), {n: p.grad for n, p in pipe.named_parameters()})
            )
        (loss_f, g_f), (loss_p, g_p) = runs
        worst = max(
            worst, rel_err(loss_f, loss_p), *(rel_err(g_f[n], g_p[n], floor=1e-3) for n in g_p)
        )
    return worst


def test_pipeline_parallel_step_pp2_tp2():
    assert max(run_distributed(_pipeline_body, 4, timeout_s=120)) <= TOL


def largest_saved_bytes(fn) -> int:
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return max(sizes)


def test_no_token_by_vocab_tensor_saved_for_backward():
    """512 tokens x 1024 columns: the unfused loss saves its float32 softmax (2 MiB); the fused one
    saves nothing larger than the weight or the hidden states (32 KiB)."""
    n, h, vocab = 512, 16, 1000
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, generator=g, requires_grad=True)
    w = torch.randn(padded_vocab_size(vocab, 1, 128), h, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, (n,), generator=g)
    logits_bytes = n * vocab * 4
    fused = largest_saved_bytes(
        lambda: fused_linear_cross_entropy(x, w, None, t, vocab_size=vocab, chunk_tokens=64)
    )
    plain = largest_saved_bytes(
        lambda: vocab_parallel_cross_entropy(F.linear(x, w), t, vocab_size=vocab)
    )
    assert plain >= logits_bytes  # the check can see a [tokens, V] float32 tensor
    assert fused * 16 <= logits_bytes, f"fused saves {fused} bytes, logits are {logits_bytes}"


def test_bfloat16_and_no_grad():
    """bf16 (the matmuls in bf16, softmax math in float32) agrees with the unfused bf16 head to bf16
    rounding; without grad the fused path returns the same float32 losses and builds no graph."""
    hidden, weight, bias, target, _ = make_inputs(1)
    kw = dict(vocab_size=V, label_smoothing=0.1)
    xs, ws = (
        [hidden.bfloat16().requires_grad_() for _ in range(2)],
        [weight.bfloat16().requires_grad_() for _ in range(2)],
    )
    fused = fused_linear_cross_entropy(xs[0], ws[0], None, target, chunk_tokens=CHUNK, **kw)
    plain = vocab_parallel_cross_entropy(F.linear(xs[1], ws[1]), target, **kw)
    assert fused.dtype == torch.float32 and rel_err(fused, plain) < 1e-2
    for out, x in ((fused, xs[0]), (plain, xs[1])):
        reduce_losses(out, target, None).backward()
    assert xs[0].grad.dtype == ws[0].grad.dtype == torch.bfloat16
    assert rel_err(xs[0].grad, xs[1].grad) < 2e-2 and rel_err(ws[0].grad, ws[1].grad) < 2e-2
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, bias, target, chunk_tokens=CHUNK, **kw)
        ref = vocab_parallel_cross_entropy(F.linear(hidden, weight, bias), target, **kw)
    assert loss.grad_fn is None and rel_err(loss, ref) <= TOL


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(label_smoothing=1.0), "label_smoothing"),
        (dict(chunk_tokens=0), "chunk_tokens must be a positive int"),
        (dict(target=torch.zeros(3, 5, dtype=torch.long)), r"target \(3, 5\)"),
        (dict(weight=torch.zeros(304, 8)), "h = 16"),
        (dict(bias=torch.zeros(300)), r"must be \[304\]"),
    ],
)
def test_errors_name_the_numbers(kw, match):
    hidden, weight, bias, target, _ = make_inputs(1)
    args = dict(hidden=hidden, weight=weight, bias=bias, target=target)
    kw = dict(kw)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(**args, vocab_size=V, **kw)


def test_config_switch_validated():
    with pytest.raises(ValueError, match="fused_loss_chunk_tokens must be an int >= 0"):
        tiny("llama", fused_loss_chunk_tokens=-1)
    assert tiny("llama").fused_loss_chunk_tokens == 0


def test_summed_reduction_equals_the_sum_of_the_per_token_losses():
    """``reduction="sum"`` (the LM head's; its backward scales by one number without a check) gives the
    per-token path's sum and gradients to TOL, with label smoothing, ignored tokens and a bias."""
    hidden, weight, bias, target, _ = make_inputs(1)
    out = []
    for reduction in ("none", "sum"):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss = fused_linear_cross_entropy(
            *leaves,
            target,
            vocab_size=V,
            label_smoothing=0.1,
            chunk_tokens=CHUNK,
            reduction=reduction,
        )
        total = loss.sum() if reduction == "none" else loss
        assert total.dim() == 0
        (total * 0.37).backward()
        out.append([total.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(NAMES, *out):
        assert rel_err(a, b) <= TOL, name
    with pytest.raises(ValueError, match="reduction must be"):
        fused_linear_cross_entropy(hidden, weight, bias, target, vocab_size=V, reduction="mean")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_summed_weight_gradient_is_scaled_before_the_cast(dtype):
    """The head's mean over 4096 tokens of one target: the weight gradient's sum over tokens (~-1.2e5)
    is beyond fp16's range, its mean is not. The sums stay float32 until backward has multiplied them by
    the mean's 1/N, so the fp16 / bf16 gradient equals the float32 one to the dtype's rounding (one
    rounding of values of order 30: 2^-10 relative for fp16, 2^-7 for bf16, bounded here by 2x that).
    Cast before scaling, the fp16 gradient would be inf."""
    n, h, v = 4096, 4, 8
    hidden = torch.full((n, h), 30.0)
    weight = torch.linspace(-0.01, 0.01, v * h).reshape(v, h)
    target = torch.zeros(n, dtype=torch.long)
    grads = []
    for dt in (torch.float32, dtype):
        w = weight.to(dt).detach().clone().requires_grad_()
        loss = fused_linear_cross_entropy(
            hidden.to(dt), w, None, target, vocab_size=v, chunk_tokens=1000, reduction="sum"
        )
        (loss / n).backward()
        grads.append(w.grad.float())
    ref, low = grads
    assert torch.isfinite(low).all()
    assert rel_err(low, ref) <= 2 * (2.0**-10 if dtype == torch.float16 else 2.0**-7)
