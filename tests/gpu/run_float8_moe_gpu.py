"""GPU check of plait's float8 MoE experts (``plait.precision.float8_moe``) on an H100/H200 (compute capability
9.0; torchao's float8 grouped GEMM has no CPU path, so tests/test_float8_moe.py checks the rest on a CPU):

    python tests/gpu/run_float8_moe_gpu.py

The reference is torchao's own conversion: the same bf16 ``MoE`` whose expert weights torchao swapped for its
``Float8TrainingWeightWrapperTensor`` (``Float8TrainingOpConfig``, rowwise), which turns the layer's
``torch._grouped_mm`` into torchao's float8 grouped GEMM (as torchtitan converts its experts). Same weights,
same inputs, forward and backward; l2 relative error (``helpers.rel_err``) of the output, the input gradient
and the three expert weight gradients.

1. Aligned groups (each expert 0 or a multiple of 16 rows, one empty): plait vs torchao's converted experts.
2. Unaligned groups (37, 0, 101, 5, ...): plait (its own zero-row padding) vs torchao's converted experts on
   rows padded by torchao's ``torch_pad_token_groups`` and unpadded by ``torch_unpad_token_groups``.
   Tolerance of 1 and 2: 2^-8 (one bf16 ulp). Both sides quantize the same operands with the same torchao
   kernels and call the same ``torch._scaled_grouped_mm``; plait's buffer has more zero rows (and its last
   group the tail), which may change the kernel's tiling, so its float32 accumulation order, before the bf16
   output rounding. Broken variant: the unconverted bf16 experts differ by float8's rounding (e4m3: 3
   mantissa bits: 6.6e-2 under the CPU emulation) and must fail the bound.
3. A whole ``Float8MoE`` layer (router, dispatch, combine) against the bf16 ``MoE``: within 0.15, every
   gradient finite (float8's own rounding: 6.7e-2 on every tensor under an emulation of torchao's casts on a
   CPU at these shapes). Compiled (inductor) against eager: within 4e-2. Inductor rounds silu(gate) * up to
   bf16 once where eager rounds twice; a changed bf16 ulp (2^-8) moves about 1 in 16 of those elements of the
   down GEMM's input to the neighbouring e4m3 value (2^-3 apart): ~1-2e-2 expected, under half of float8's
   own error, while a wrong compiled path is off by O(1).
4. The engine: a small MoE Llama (bf16, ZeRO-2, ZeRO-3 and ZeRO-2 compiled), fp8 rowwise: every MoE layer a
   ``Float8MoE``, 5 steps' losses finite and within 2% of the bf16 run's (a smoke test: near-initial losses).
5. Time of one Mixtral-8x7B-shaped expert layer (hidden 4096, width 14336, 8 experts, 8192 tokens top-2),
   forward + backward of the experts, bf16 ``torch._grouped_mm`` vs float8, median of 5 (printed, no bound).
Prints one line per check; exit status 1 on any failure.
"""

import copy
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import rel_err

import plait
from plait.layers import MoE, TransformerModel
from plait.layers.init import init_parameters
from plait.models import preset
from plait.parallel import ParallelMesh
from plait.precision.float8_moe import Float8MoE

ULP = 2.0**-8
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def torchao_converted(moe: MoE) -> MoE:
    """A copy of ``moe`` whose expert weights torchao converted (its MoE training tensor subclass)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.conversion_utils import _swap_params

    ref = copy.deepcopy(moe)
    for name in EXPERT_WEIGHTS:
        _swap_params(
            ref,
            config=Float8TrainingOpConfig(),
            module_filter_fn=lambda m, fqn: fqn == "",
            target_parameter_name=name,
        )
    return ref


def torchao_experts(ref: MoE, xs, rows):
    """``ref``'s own ``_experts`` (plait's ``torch._grouped_mm`` call, which torchao's weights take over)."""
    return ref._experts(xs, rows)


def torchao_padded_experts(ref: MoE, xs, rows):
    """``ref``'s experts (torchao-converted weights) on rows padded and unpadded by torchao's own helpers."""
    from torchao.prototype.moe_training.kernels.mxfp8.quant import (
        torch_pad_token_groups,
        torch_unpad_token_groups,
    )

    ends = torch.cumsum(rows, 0).to(torch.int32)
    padded, starts, padded_ends = torch_pad_token_groups(xs, ends, 16)
    padded = padded[: int(padded_ends[-1])]

    def mm(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=padded_ends)

    out = mm(F.silu(mm(padded, ref.gate_proj)) * mm(padded, ref.up_proj), ref.down_proj)
    return torch_unpad_token_groups(out, ends, starts, xs.shape[0], 16)


def run_experts(fn, moe, xs, up):
    """Output, input gradient and expert weight gradients of ``(fn(xs) * up).sum()``."""
    moe.zero_grad()
    x = xs.clone().requires_grad_()
    y = fn(x)
    (y.float() * up).sum().backward()
    return [y.detach(), x.grad] + [getattr(moe, n).grad for n in EXPERT_WEIGHTS]


def bf16_moe(hidden, ffn, experts, seed=0):
    moe = MoE(hidden, ffn, experts, 2, device="cuda", dtype=torch.bfloat16)
    init_parameters(moe, seed=seed)
    return moe


def report(name, errs, bound, failures, broken=None):
    ok = max(errs) <= bound and (broken is None or broken > bound)
    extra = "" if broken is None else f"; bf16 experts (broken variant) {broken:.1e} must exceed it"
    print(
        f"{name}: rel err (y, dx, d gate, d up, d down) {[f'{e:.1e}' for e in errs]} <= {bound:.1e}"
        f"{extra}: {'ok' if ok else 'FAIL'}",
        flush=True,
    )
    if not ok:
        failures.append(name)


def check_parity(failures, name, rows, reference):
    """plait's float8 experts vs ``reference(ref, xs, rows)`` on ``rows`` per expert; bf16 as broken."""
    g = torch.Generator(device="cuda").manual_seed(1)
    moe = bf16_moe(512, 256, len(rows))
    m = int(sum(rows))
    xs = torch.randn(m, 512, device="cuda", generator=g).bfloat16()
    up = torch.randn(m, 512, device="cuda", generator=g)
    rows = torch.tensor(rows, device="cuda")
    ref = torchao_converted(moe)
    want = run_experts(lambda x: reference(ref, x, rows), ref, xs, up)
    f8 = Float8MoE(copy.deepcopy(moe))
    got = run_experts(lambda x: f8._experts(x, rows), f8, xs, up)
    plain = run_experts(lambda x: moe._experts(x, rows), moe, xs, up)
    errs = [rel_err(a, b) for a, b in zip(got, want)]
    report(name, errs, ULP, failures, broken=max(rel_err(a, b) for a, b in zip(plain, want)))


def check_layer_and_compile(failures):
    g = torch.Generator(device="cuda").manual_seed(2)
    moe = bf16_moe(1024, 512, 8, seed=3)
    x = torch.randn(4, 512, 1024, device="cuda", generator=g).bfloat16()
    up = torch.randn(x.shape, device="cuda", generator=g)
    f8 = Float8MoE(copy.deepcopy(moe))

    def layer(module):
        return lambda t: module(t.view(4, 512, 1024))[0].view(-1, 1024)

    flat, upf = x.view(-1, 1024), up.view(-1, 1024)
    want = run_experts(layer(moe), moe, flat, upf)
    got = run_experts(layer(f8), f8, flat, upf)
    errs = [rel_err(a, b) for a, b in zip(got, want)]
    finite = all(torch.isfinite(p.grad).all() for p in f8.parameters())
    report("layer: Float8MoE vs bf16 MoE (float8 rounding)", errs, 0.15, failures)
    if not finite:
        failures.append("layer gradients not finite")
    compiled = torch.compile(f8)
    got_c = run_experts(layer(compiled), f8, flat, upf)
    report(
        "layer: compiled vs eager Float8MoE",
        [rel_err(a, b) for a, b in zip(got_c, got)],
        4e-2,
        failures,
    )


def engine_losses(fp8: bool, stage: int, compiled: bool):
    cfg = preset(
        "llama-tiny",
        vocab_size=1024,
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=512,
        num_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=256,
    )
    conf = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "fp8": {"enabled": fp8, "recipe": "rowwise"},
        "compile": {"enabled": compiled},
    }
    engine = plait.initialize(
        TransformerModel(cfg, None, seed=5, device="cuda"), conf, mesh=ParallelMesh()
    )
    kinds = {type(m).__name__ for m in engine.module.modules() if isinstance(m, MoE)}
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(5):
        ids = torch.randint(0, 1024, (4, 129), generator=g).cuda()
        loss = engine(input_ids=ids[:, :-1], labels=ids[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return kinds, losses


def check_engine(failures):
    for stage, compiled in ((2, False), (3, False), (2, True)):
        name = f"engine ZeRO-{stage}{' compiled' if compiled else ''}"
        try:
            kinds, f8 = engine_losses(True, stage, compiled)
            _, bf = engine_losses(False, stage, compiled)
        except (RuntimeError, ValueError, TypeError, AssertionError) as err:  # report, go on
            print(f"{name}: FAIL: {type(err).__name__}: {err}", flush=True)
            failures.append(name)
            continue
        ok = kinds == {"Float8MoE"} and all(
            torch.isfinite(torch.tensor(a)) and abs(a - b) <= 0.02 * abs(b) for a, b in zip(f8, bf)
        )
        print(
            f"{name}: MoE layers {sorted(kinds)}; fp8 losses {[f'{v:.4f}' for v in f8]} vs bf16 "
            f"{[f'{v:.4f}' for v in bf]}: {'ok' if ok else 'FAIL'}",
            flush=True,
        )
        if not ok:
            failures.append(name)


def time_experts():
    moe = bf16_moe(4096, 14336, 8, seed=4)
    f8 = Float8MoE(copy.deepcopy(moe))
    tokens, g = 8192, torch.Generator(device="cuda").manual_seed(5)
    experts = torch.randint(0, 8, (tokens * 2,), device="cuda", generator=g)
    rows = torch.bincount(experts, minlength=8)
    xs = torch.randn(tokens * 2, 4096, device="cuda", generator=g).bfloat16()
    up = torch.randn(tokens * 2, 4096, device="cuda", generator=g)
    result, outputs = {}, {}
    for name, module in (("bf16", moe), ("float8", f8)):
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outputs[name] = run_experts(lambda x, m=module: m._experts(x, rows), module, xs, up)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        result[name] = sorted(times[1:])[2] * 1e3
    errs = [rel_err(a, b) for a, b in zip(outputs["float8"], outputs["bf16"])]
    print(
        f"Mixtral-8x7B experts, 8192 tokens top-2, fwd+bwd: bf16 {result['bf16']:.1f} ms, float8 "
        f"{result['float8']:.1f} ms ({result['bf16'] / result['float8']:.2f}x), median of 5; float8 vs "
        f"bf16 rel err (y, dx, d gate, d up, d down) {[f'{e:.1e}' for e in errs]}",
        flush=True,
    )


def main():
    name = torch.cuda.get_device_name()
    print(f"{name}, compute capability {torch.cuda.get_device_capability()}", flush=True)
    failures = []
    check_parity(
        failures, "aligned groups vs torchao", [64, 0, 128, 32, 16, 48, 80, 16], torchao_experts
    )
    check_parity(
        failures,
        "unaligned groups vs torchao padded",
        [37, 0, 101, 5, 64, 23, 1, 153],
        torchao_padded_experts,
    )
    check_layer_and_compile(failures)
    check_engine(failures)
    time_experts()
    print("FAILED: " + ", ".join(failures) if failures else "all checks ok", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
