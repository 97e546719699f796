"""Host cost of one pipeline stage's actions on GPU: plait's F, B, BI, BW against Hugging Face's Llama layers.

    python benchmarks/probe_pipeline_host.py [--preset llama-886m] [--seq 2048] [--batch 1] [--top 30]

Stage: blocks 9..16 plus the LM head of the preset (pp=2's last stage), bf16, one micro-batch. Per action:
host ms to issue it (no synchronization) and device ms until it finished (synchronized), mean of 10 after 3
warm-ups. Peer: transformers' ``LlamaModel`` with the same 8 layers on ``inputs_embeds`` (sdpa attention),
forward and backward, the same way. Then torch.profiler's top host ops (self CPU time) of plait's F + B
and of BI + BW, and the share of BI spent walking the graph (``pipeline_backward._analyse``).
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(fn, reps=10, warmup=3):
    host = dev = 0.0
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= warmup:
            host, dev = host + (t1 - t0) / reps, dev + (time.perf_counter() - t0) / reps
    return 1e3 * host, 1e3 * dev


def plait_stage(args, device):
    from plait.models import preset
    from plait.layers.model import TransformerModel

    cfg = preset(args.preset, max_position_embeddings=max(2048, args.seq))
    half = cfg.num_layers // 2
    model = TransformerModel(cfg, layers=range(half + 1, cfg.num_layers + 2), seed=0).to(
        device, torch.bfloat16
    )
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    x = torch.randn(
        args.batch,
        args.seq,
        cfg.hidden_size,
        device=device,
        dtype=torch.bfloat16,
        requires_grad=True,
    )
    return cfg, model, {"labels": ids}, x


def hf_stage(cfg, args, device):
    from transformers import LlamaConfig, LlamaModel

    hf = LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        num_hidden_layers=cfg.num_layers // 2,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=max(2048, args.seq),
        attn_implementation="sdpa",
    )
    return LlamaModel(hf).to(device, torch.bfloat16)


def walk_ms(pb, fwd, bi, bw, reps=5) -> float:
    """Mean ms BI spends in ``pipeline_backward._analyse`` (the graph walk), over ``reps`` F/BI/BW rounds."""
    analyse, walk = pb._analyse, []

    def timed_analyse(*a):
        t0 = time.perf_counter()
        out = analyse(*a)
        walk.append(time.perf_counter() - t0)
        return out

    pb._analyse = timed_analyse
    try:
        for _ in range(reps):
            fwd()
            bi()
            bw()
    finally:
        pb._analyse = analyse
    return 1e3 * sum(walk) / len(walk)


def main():
    from plait.parallel.pipeline import backward as pb

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="llama-886m")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    cfg, model, batch, x = plait_stage(args, device)
    state = {}

    def fwd():
        state["out"] = model(hidden=x, **batch)

    def bwd():
        state["out"].backward()

    def bi():
        state["gx"], state["pending"] = pb.backward_input(state.pop("out"), None, x)

    def bw():
        pb.backward_weight(state.pop("pending"))

    rows = {"plait F": timed(fwd)}
    rows["plait B"] = timed(lambda: (fwd(), torch.cuda.synchronize(), bwd()))
    rows["plait BI"] = timed(lambda: (fwd(), torch.cuda.synchronize(), bi()))
    rows["plait BI+BW"] = timed(lambda: (fwd(), torch.cuda.synchronize(), bi(), bw()))
    walk = walk_ms(pb, fwd, bi, bw)
    hf = hf_stage(cfg, args, device)
    emb = x.detach().clone().requires_grad_(True)
    rows["HF F (8 layers, no head)"] = timed(
        lambda: state.__setitem__("hf", hf(inputs_embeds=emb).last_hidden_state)
    )
    rows["HF F+B"] = timed(
        lambda: hf(inputs_embeds=emb).last_hidden_state.float().pow(2).mean().backward()
    )
    print(
        f"{args.preset} last stage ({cfg.num_layers // 2} blocks + head), seq {args.seq}, batch {args.batch}, "
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    )
    print("| action | host ms (issue) | device ms (to finish) |\n|---|---|---|")
    for k, (h, d) in rows.items():
        print(f"| {k} | {h:.2f} | {d:.2f} |")
    print(f"graph walk in BI: {walk:.2f} ms")
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("F+B", lambda: (fwd(), bwd())), ("F+BI+BW", lambda: (fwd(), bi(), bw()))):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
        host = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
        print(f"\n{name}: | host ms (self) | calls | op |\n|---|---|---|")
        for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[: args.top]:
            print(f"| {e.self_cpu_time_total / 1e3:.2f} | {e.count} | {e.key[:100]} |")


if __name__ == "__main__":
    main()
