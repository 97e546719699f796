"""CPU timing of the zero-bubble backward split: plain backward (B) vs BI + BW on one chunk.

    python benchmarks/bench_zb_split.py [--blocks 4] [--hidden 512] [--seq 256] [--batch 2] [--reps 5]
        [--head] [--threads N]

Chunk: ``TransformerModel`` with blocks 1..blocks of a Llama config (hidden 512, ffn 1376, 8 heads,
4 kv heads; float32) as a middle pipeline stage: input ``[batch, seq, hidden]`` that requires grad,
output of the same shape with a random output gradient. ``--head`` adds the LM head (last stage:
scalar loss). Per repetition the forward runs untimed, then B (``torch.autograd.backward``) or BI
(``backward_input``) and BW (``backward_weight``) are timed. Reports the median and minimum over
``--reps`` after 2 warm-ups, the BI/BW split, the path BW took (split / fallback, and how many
per-node engine calls it made) and the largest relative difference between the two ways' parameter
and input gradients (0 means bitwise equal).

The default shape is compute-bound on CPU. A host-bound proxy for GPUs (where the kernels are fast
and the Python/engine overhead per node is what a stage waits on):

    python benchmarks/bench_zb_split.py --threads 1 --reps 40 --hidden 64 --ffn 176 --seq 16 --blocks 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(args):
    from plait.models import preset
    from plait.layers.model import TransformerModel

    cfg = preset(
        "llama-tiny",
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        num_layers=args.blocks,
        max_position_embeddings=max(256, args.seq),
    )
    last = args.blocks + 1
    layers = range(1, last + 1) if args.head else range(1, last)
    return TransformerModel(cfg, layers=layers, seed=0), cfg


def run_once(model, args, gen, split: bool):
    from plait.parallel.pipeline.backward import backward_input, backward_weight

    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen, requires_grad=True)
    batch = {}
    if args.head:
        batch["labels"] = torch.randint(0, 8192, (args.batch, args.seq), generator=gen)
    out = model(hidden=x, **batch)
    g = None if out.dim() == 0 else torch.randn(out.shape, generator=gen)
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    if not split:
        torch.autograd.backward(out, g, inputs=[x, *model.parameters()])
        t1 = t2 = time.perf_counter()
        gx, path = x.grad, "B"
    else:
        gx, pending = backward_input(out, g, x)
        t1 = time.perf_counter()
        path = "split" if pending.split else "fallback"
        del out
        calls = [0]
        grad = torch.autograd.grad

        def counting(*a, **k):  # per-node engine calls BW makes (nodes weight_grads does not cover)
            calls[0] += 1
            return grad(*a, **k)

        torch.autograd.grad = counting
        try:
            t1 = time.perf_counter()
            backward_weight(pending)
            t2 = time.perf_counter()
        finally:
            torch.autograd.grad = grad
        path += f" ({calls[0]} per-node engine calls)"
    grads = [gx] + [p.grad for p in model.parameters()]
    return t1 - t0, t2 - t1, path, grads


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1376)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--head", action="store_true", help="include the LM head (last stage, scalar loss)"
    )
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = build(args)
    times = {"B": [], "BI": [], "BW": []}
    paths = set()
    worst = 0.0
    for rep in range(args.warmup + args.reps):
        seed = 1000 + rep
        tb, _, _, ref = run_once(model, args, torch.Generator().manual_seed(seed), split=False)
        ti, tw, path, got = run_once(model, args, torch.Generator().manual_seed(seed), split=True)
        paths.add(path)
        for a, b in zip(ref, got):
            if a is None or b is None:
                if a is not b:
                    raise AssertionError("a gradient is missing on one side")
                continue
            worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp(min=1e-30)).item())
        if rep >= args.warmup:
            times["B"].append(tb)
            times["BI"].append(ti)
            times["BW"].append(tw)
    times["BI+BW"] = [i + w for i, w in zip(times["BI"], times["BW"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    print(
        f"chunk: {args.blocks} llama blocks{' + head' if args.head else ''}, hidden {args.hidden}, "
        f"ffn {args.ffn}, heads {args.heads}/{args.kv_heads}, seq {args.seq}, batch {args.batch}, float32, "
        f"{torch.get_num_threads()} threads, median of {args.reps}"
    )
    print(f"{'':8s} {'median ms':>10s} {'min ms':>10s}")
    for k in ("B", "BI", "BW", "BI+BW"):
        print(f"{k:8s} {med[k] * 1e3:10.2f} {low[k] * 1e3:10.2f}")
    print(
        f"ratio (BI+BW)/B: median {med['BI+BW'] / med['B']:.3f}, min {low['BI+BW'] / low['B']:.3f}; "
        f"path: {sorted(paths)}"
    )
    print(f"max relative gradient difference: {worst:.2e}")


if __name__ == "__main__":
    main()
