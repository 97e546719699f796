"""Issue 17 on one GPU: the 8-expert top-2 MoE layer at ep=1, grouped GEMM against a matmul per expert and
against a dense SwiGLU MLP with the same active parameters.

    PYTHONPATH=$PWD python benchmarks/bench_moe_layer.py [--hidden 2048] [--ffn 2816] [--experts 8] [--top-k 2]
        [--tokens 8192] [--steps 20] [--out bench_moe_layer.jsonl]

One process, bf16 parameters and inputs, forward and backward of the layer alone (no optimizer), ``--tokens``
tokens per step (``[tokens / 2048, 2048, hidden]``), 3 warm-up steps then ``--steps`` timed. Arms:

- moe-grouped: ``plait.layers.MoE`` (dropless, softmax then top-k, normalized), each projection one
  ``torch._grouped_mm`` over the experts.
- moe-loop: the same layer and weights with ``grouped_gemm=False`` (one matmul per expert).
- dense: ``plait.layers.mlp.MLP`` SwiGLU of inner width ``top_k x ffn``: the active parameters of a token.

Reported: tokens/s, MFU on active parameters (6 x (top_k x 3 x hidden x ffn + hidden x experts) flops per token
for the MoE arms, 6 x 3 x hidden x top_k x ffn for dense, against 989e12), peak GiB, and moe-loop's output
against moe-grouped's on the same input (relative l2; both bf16).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PEAK_FLOPS = 989e12


def build(arm: str, args, device):
    from plait.layers.init import init_parameters
    from plait.layers.mlp import MLP
    from plait.layers.moe import MoE

    if arm == "dense":
        layer = MLP(
            args.hidden,
            args.top_k * args.ffn,
            "swiglu",
            bias=False,
            device=device,
            dtype=torch.bfloat16,
        )
        active = 3 * args.hidden * args.top_k * args.ffn
    else:
        layer = MoE(
            args.hidden,
            args.ffn,
            args.experts,
            args.top_k,
            grouped_gemm=arm == "moe-grouped",
            device=device,
            dtype=torch.bfloat16,
        )
        active = args.top_k * 3 * args.hidden * args.ffn + args.hidden * args.experts
    init_parameters(layer, seed=0)
    return layer, active


def run(layer, x, up):
    out = layer(x)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(up)
    return y


def measure(arm: str, args, device, x, up) -> tuple[dict, torch.Tensor]:
    layer, active = build(arm, args, device)
    for _ in range(3):
        y = run(layer, x, up)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        y = run(layer, x, up)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    tokens = x.shape[0] * x.shape[1] / dt
    row = {
        "arm": arm,
        "tokens_per_s": tokens,
        "mfu": tokens * 6 * active / PEAK_FLOPS,
        "step_ms": dt * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "active_params": active,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }
    return row, y.detach().float()


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="bench_moe_layer.jsonl")
    args = p.parse_args()
    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.tokens // 2048, 2048, args.hidden)
    x = torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
    up = torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
    rows, outs = [], {}
    for arm in ("moe-grouped", "moe-loop", "dense"):
        row, outs[arm] = measure(arm, args, device, x, up)
        rows.append(row)
    diff = ((outs["moe-loop"] - outs["moe-grouped"]).norm() / outs["moe-grouped"].norm()).item()
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps({**row, **vars(args), "loop_vs_grouped": diff}) + "\n")
    print(
        f"\nMoE layer {args.experts} experts top-{args.top_k}, hidden {args.hidden}, expert ffn {args.ffn}, "
        f"{args.tokens} tokens, bf16, forward + backward; {rows[0]['device']}, torch {rows[0]['torch']}\n"
    )
    print(
        "| arm | tokens/s | MFU (active) | step ms | peak GiB | x moe-loop |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['arm']} | {r['tokens_per_s'] / 1e3:.1f}k | {r['mfu']:.1%} | {r['step_ms']:.2f} "
            f"| {r['peak_gib']:.2f} | {r['tokens_per_s'] / rows[1]['tokens_per_s']:.2f} |"
        )
    print(f"\nmoe-loop output against moe-grouped's (relative l2): {diff:.1e}")


if __name__ == "__main__":
    main()
