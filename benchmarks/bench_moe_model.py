"""Issues 17 / 24: an 8-expert top-2 model of about 1B active parameters trained on 2 GPUs at ep=2, against the
same model with a per-expert loop, with every expert on both GPUs (ep=1), and against a dense model of the same
active parameters.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/bench_moe_model.py [--arms moe-ep2,moe-ep2-loop,moe-ep1,dense]
        [--steps 10] [--micro 2] [--gas 1] [--seq 2048] [--timeout 600] [--out bench_moe.jsonl] [--logs DIR]
        [--profile] [--compile]
    python benchmarks/bench_moe_model.py --report a.jsonl ...          # the table of earlier runs

Each arm runs under ``torch.distributed.run --standalone --nproc-per-node 2`` in a process group of its own (a
failure, e.g. CUDA out of memory, becomes a row with its error). Every arm trains through ``plait.initialize``
with ``_common.ds_like_config(1)`` (ZeRO-1, bf16, AdamW lr 1e-4 wd 0.1, clip 1.0), dp 2, ``--gas`` micro-batches
of ``--micro`` sequences of ``--seq`` random tokens per rank and optimizer step (``_common.batch`` seeded by
micro-batch and rank), no activation checkpointing: two warm-up steps, then ``--steps`` timed.

- moe-ep2: ``preset("mixtral-1b-active")`` (hidden 2048, 16 blocks, 16 heads on 8 kv heads, 8 SwiGLU experts of
  3584, top-2, vocabulary 32000: 3.15B parameters, 1.04B active) on ``ParallelMesh(ep=2)``: each GPU holds 4
  experts per block, the tokens cross by all-to-all; the experts' matmuls as grouped GEMMs
  (``torch._grouped_mm``).
- moe-ep2-loop: the same with ``MoE.grouped_gemm = False``: one matmul per expert.
- moe-ep1: the same model on ``ParallelMesh()`` (ep 1): every GPU holds all 8 experts, no all-to-all.
- dense: the same Llama without experts, its MLP 7168 wide (top-2 x 3584): 1.04B parameters, all active.

Reported: tokens/s per GPU, MFU on active parameters (tokens/s/GPU x (6 N_active + 6 x layers x hidden x seq)
/ 989e12, ``_common``), peak GiB (the larger of the two ranks' ``max_memory_allocated`` over the timed steps),
the last step's loss (mean over the ranks), and each arm over moe-ep2 and over dense.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import PEAK_FLOPS, batch, child_or_report, ds_like_config, known_arms, run_arms  # noqa: E402
from _common import profile_steps, timed_steps  # noqa: E402

ARMS = ("moe-ep2", "moe-ep2-loop", "moe-ep1", "dense")
MODEL = "mixtral-1b-active"


def model_config(arm: str):
    from plait.models import preset

    cfg = preset(MODEL)
    if arm == "dense":
        return preset(
            "llama-886m",
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            rope_theta=cfg.rope_theta,
            ffn_hidden_size=cfg.moe_top_k * cfg.moe_ffn_hidden_size,
        )
    return cfg


def run_arm(arm: str, args) -> dict:
    """On both ranks: build, two warm-up steps, ``--steps`` timed steps; rank 0 returns the row."""
    import torch.distributed as dist

    import plait
    from bench_zero import init_distributed
    from plait.layers import MoE, TransformerModel
    from plait.parallel import ParallelMesh

    torch.backends.cuda.matmul.allow_tf32 = True
    device = init_distributed()
    cfg = model_config(arm)
    mesh = ParallelMesh(ep=2 if arm.startswith("moe-ep2") else 1)
    model = TransformerModel(cfg, mesh, seed=0, device=device)
    for layer in model.modules():
        if isinstance(layer, MoE):
            layer.grouped_gemm = arm != "moe-ep2-loop"
    conf = ds_like_config(1)
    conf["train_micro_batch_size_per_gpu"], conf["gradient_accumulation_steps"] = (
        args.micro,
        args.gas,
    )
    conf["compile"] = {
        "enabled": args.compile
    }  # torch.compile of every block (plait.engine.compile)
    engine = plait.initialize(model, conf, mesh=mesh)
    rank = dist.get_rank()

    def step(i):
        for g in range(args.gas):
            loss = engine(
                **batch(
                    cfg, device, 1000 * (args.gas * i + g) + rank, micro=args.micro, seq=args.seq
                )
            )
            engine.backward(loss)
            engine.step()  # applies at the accumulation boundary
        return loss

    t0 = time.perf_counter()
    for i in range(2):
        step(i)
    torch.cuda.synchronize()
    warmup = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    timed = timed_steps(step, 2, args.steps, args.gc)
    loss, dt = timed["loss"], timed["step_s"]
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    if args.profile and rank == 0:
        profile_steps(step, 2 + args.steps, arm)
    elif args.profile:
        for i in range(2):  # the same steps as rank 0's profiled ones (their collectives)
            step(2 + args.steps + i)
    moe = engine.moe_stats()
    active, seq = cfg.num_active_parameters(), args.seq
    tokens_gpu = args.gas * args.micro * seq / dt
    flops = 6 * active + 6 * cfg.num_layers * cfg.hidden_size * seq
    return {
        "arm": arm,
        "model": MODEL if arm != "dense" else "dense",
        "ep": mesh.ep,
        "nproc": dist.get_world_size(),
        "micro": args.micro,
        "gas": args.gas,
        "compile": args.compile,
        "seq": seq,
        "tokens_per_s_gpu": tokens_gpu,
        "mfu": tokens_gpu * flops / PEAK_FLOPS,
        "peak_gib": peak.item() / 2**30,
        "step_s": dt,
        "warmup_s": warmup,
        "loss": total.item() / 2,
        "params": cfg.num_parameters(),
        "active_params": active,
        "steps": args.steps,
        "imbalance": moe["load_imbalance"] if moe else None,
        "step_ms": timed["step_ms"],
        "gc": args.gc,
        "gc_pauses_ms": timed["gc_pauses_ms"],
        "cpu_count": len(os.sched_getaffinity(0)),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }


def report(rows) -> str:
    by = {r["arm"]: r for r in rows if "device" in r}
    ok = list(by.values())
    about = f"{ok[0]['device']}, torch {ok[0]['torch']}" if ok else "no row ran"
    out = [
        f"{MODEL} (8 experts, top-2) and its dense twin, 2 GPUs ({about}): dp 2, ZeRO-1, bf16, AdamW, "
        f"micro-batch {rows[0].get('micro')} x seq {rows[0].get('seq')} x accumulation {rows[0].get('gas', 1)} per "
        f"GPU and step, no activation checkpointing, compile {'on' if rows[0].get('compile') else 'off'}",
        "",
        "| arm | ep | params | active | tokens/s/GPU | MFU (active) | peak GiB | step s | loss | imbalance "
        "| x moe-ep2 | x dense |",
        "|---" * 12 + "|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['arm']} | failed: {r['error'][:300].replace('|', '/')} |" + " |" * 10)
            continue
        ratios = [
            f"{r['tokens_per_s_gpu'] / by[b]['tokens_per_s_gpu']:.3f}" if b in by else ""
            for b in ("moe-ep2", "dense")
        ]
        imb = f"{r['imbalance']:.2f}" if r.get("imbalance") else ""
        out.append(
            f"| {r['arm']} | {r['ep']} | {r['params'] / 1e9:.2f}B | {r['active_params'] / 1e9:.2f}B | "
            f"{r['tokens_per_s_gpu'] / 1e3:.1f}k | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | "
            f"{r['step_s']:.3f} | {r['loss']:.4f} | {imb} | {ratios[0]} | {ratios[1]} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--gas", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--compile", action="store_true", help="torch.compile every block (every arm)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="bench_moe.jsonl")
    p.add_argument("--logs")
    p.add_argument(
        "--gc",
        choices=("auto", "freeze"),
        default="auto",
        help="freeze: gc.collect() and gc.freeze() after the warm-up (_common.timed_steps)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile 2 more on rank 0 (its log)",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--report", nargs="+")
    args = p.parse_args()
    if child_or_report(args, run_arm, report):
        return
    child = (
        [
            "--steps",
            str(args.steps),
            "--micro",
            str(args.micro),
            "--gas",
            str(args.gas),
            "--seq",
            str(args.seq),
            "--gc",
            args.gc,
        ]
        + (["--profile"] if args.profile else [])
        + (["--compile"] if args.compile else [])
    )
    # TORCHRUN_ARGS: more torchrun options, e.g. "--numa-binding node" (each rank's host threads on its GPU's node)
    launcher = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *os.environ.get("TORCHRUN_ARGS", "").split(),
    ]
    rows = run_arms(__file__, known_arms(args.arms, ARMS), args, child, launcher=launcher)
    print(report(rows))


if __name__ == "__main__":
    main()
