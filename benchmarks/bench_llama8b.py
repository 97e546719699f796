"""Issue 47: Llama-3-8B (plait's preset "llama3-8b") at seq 8192 on ``--nproc`` GPUs of one host: tokens/s per
GPU, MFU and peak memory of plait against torchtitan, FSDP2 by hand and DeepSpeed ZeRO-3, and plait's tp / pp
layouts against its data-parallel arm; the same script at ``--nproc 1`` (dp=1) on one GPU.

    PYTHONPATH=$PWD python benchmarks/bench_llama8b.py --nproc 8 [--arms a,b,...] [--seq 8192] [--micro 1]
        [--gas 1] [--stage 3] [--recompute N] [--steps 6] [--warmup 3] [--timeout 580] [--out X.jsonl]
    python benchmarks/bench_llama8b.py --dry-run    # CPU, llama-tiny, every arm at nproc 1 and 2
    python benchmarks/bench_llama8b.py --report a.jsonl ...

Arms (each in a child process of its own, under ``torch.distributed.run`` when ``--nproc`` > 1):

- plait-bf16, plait-fp8-tensorwise, plait-fp8-tensorwise-f8gather, fsdp2-bf16, fsdp2-fp8-tensorwise,
  titan-bf16, titan-fp8-rowwise: bench_float8's arms, imported from it (its docstring says what each runs):
  plait ZeRO ``--stage`` compiled, bf16 / float8 (tensorwise; -f8gather: ZeRO-3 gathers float8 weights);
  FSDP2 + torchao by hand; torchtitan 0.3's Trainer. torchtitan 0.3.0 needs
  ``torch.distributed.fsdp.DataParallelMeshDims`` over more than one data-parallel rank, which torch 2.11 (the
  GPU image's) lacks: there its arms fail naming it at ``--nproc`` > 1, and the output says so.
- ds-z3: DeepSpeed ZeRO-3 (``_llama8b_arms.ds_arm``).
- plait-tp2, plait-pp2-zbh1, plait-pp2-1f1b: plait at tp=2 x dp=N/2 and pp=2 x dp=N/2 (ZB-H1, eager, since
  plait refuses compile under zero-bubble schedules; 1F1B compiled), the same global batch
  (``_llama8b_arms.layout_arm``).

Reported per arm: tokens/s per GPU (all ranks' tokens / step time / ranks), MFU = tokens/s per GPU x model
FLOPs per token / peak, with the FLOPs per token ``6 N + 12 L h s`` (N: parameters without the input
embedding; PaLM, Chowdhery et al. 2022 appendix B, as torchtitan's ``get_num_flop_per_token`` counts it) and the
peak one H200's dense bf16 989 TFLOP/s (float8 arms also against dense float8 1979 TFLOP/s); peak GiB (rank 0's
``torch.cuda.max_memory_allocated``; for pp, stage 0's), step and first-step seconds, and ratios against
plait-bf16 and against the peer of the recipe (torchtitan's arm where it ran, else FSDP2's).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import chosen_arms, child_or_report, palm_flops_per_token, run_arms  # noqa: E402
from _llama8b_arms import DS_ARMS, LAYOUT_ARMS, PEAK_BF16, PEAK_FP8, build  # noqa: E402
from bench_float8 import peer_of, recipe_of, run_arm, shape  # noqa: E402

ARMS = (
    "plait-bf16",
    "plait-fp8-tensorwise",
    "plait-fp8-tensorwise-f8gather",
    "fsdp2-bf16",
    "fsdp2-fp8-tensorwise",
    "titan-bf16",
    "titan-fp8-rowwise",
    *DS_ARMS,
    *LAYOUT_ARMS,
)


def measure(arm: str, args) -> dict:
    """bench_float8's ``run_arm`` with this file's builders, plus per-GPU tokens/s and MFU."""
    row = run_arm(arm, args, build)
    cfg = shape(args)
    row["flops_per_token"] = palm_flops_per_token(cfg, args.seq)
    row["parameters"] = cfg.num_parameters()
    if "tokens_per_s" in row:
        per_gpu = row["tokens_per_s"] / row["nproc"]
        row["tokens_per_s_per_gpu"] = per_gpu
        row["mfu_bf16_peak"] = per_gpu * row["flops_per_token"] / PEAK_BF16
        if recipe_of(arm):
            row["mfu_fp8_peak"] = per_gpu * row["flops_per_token"] / PEAK_FP8
    return row


def titan_note(nproc: int) -> str | None:
    """The line that says torchtitan's arms cannot run beyond one rank with this torch, or None."""
    import torch
    from torch.distributed import fsdp

    if nproc > 1 and not hasattr(fsdp, "DataParallelMeshDims"):
        return (
            f"torchtitan 0.3.0 over {nproc} ranks needs torch.distributed.fsdp.DataParallelMeshDims, "
            f"which torch {torch.__version__} lacks: its arms fail (see _titan.py); fsdp2's are the peers"
        )
    return None


def not_runnable(arm: str, nproc: int) -> str | None:
    """Why ``arm`` cannot run here at ``nproc`` ranks, or None."""
    if arm in LAYOUT_ARMS and nproc % 2:
        return f"splits the model over 2 ranks: needs an even --nproc, not {nproc}"
    if arm in DS_ARMS and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not importable here (on the GPU: carry .whl; on the CPU: DS_ACCELERATOR=cpu)"
    return None


def cell(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def report(rows) -> str:
    """A markdown table per ``nproc``: tokens/s per GPU, MFU, peak GiB, step s, ratios (see the docstring)."""
    out = []
    for nproc in sorted({r.get("nproc", 1) for r in rows}):
        group = [r for r in rows if r.get("nproc", 1) == nproc]
        by = {r["arm"]: r for r in group if "tokens_per_s" in r}
        r0 = next(iter(by.values()), group[0])
        mode = "dry run: CPU, eager -- not a measurement" if r0.get("dry_run") else "measured"
        head = (
            f"{r0.get('preset')}, {r0.get('parameters', 0) / 1e9:.2f}B parameters, seq {r0.get('seq')}, "
            f"micro-batch {r0.get('micro')}, gradient accumulation {r0.get('gas')}, ZeRO stage "
            f"{r0.get('stage')}, {nproc} x {r0.get('device')}, torch {r0.get('torch')}; {mode}; MFU: "
            f"{r0.get('flops_per_token', 0) / 1e9:.1f} GFLOP per token (6 N + 12 L h s) against a dense "
            f"peak of {PEAK_BF16 / 1e12:.0f} TFLOP/s bf16 / {PEAK_FP8 / 1e12:.0f} float8 (H200)"
        )
        columns = (
            "| arm | tokens/s/GPU | MFU bf16 peak | MFU fp8 peak | peak GiB | step s | first step s "
            "| loss | x plait-bf16 | peer | x peer |"
        )
        note = titan_note(nproc)
        out += [head, *([note] if note else []), "", columns, "|---" * 11 + "|"]
        for r in group:
            out.append(table_line(r, by))
        out.append("")
    return "\n".join(out)


def table_line(r: dict, by: dict) -> str:
    if "tokens_per_s" not in r:
        why = f"failed: {r['error']}" if "error" in r else f"not run: {r.get('not_run')}"
        return f"| {r['arm']} | {why[:300].replace('|', '/')} | | | | | | | | | |"
    arm = r["arm"]
    if "tp" in r:
        arm += f" (tp {r['tp']} x pp {r['pp']} x dp {r['dp']}, {r['micro_batches']} micro-batches)"
    if "torchtitan" in r:
        arm += f" (torchtitan {r['torchtitan']})"
    if "deepspeed" in r:
        arm += f" (DeepSpeed {r['deepspeed']})"
    peer = by.get(peer_of(r["arm"], by))

    def ratio(base):
        return f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""

    return (
        f"| {arm} | {r['tokens_per_s_per_gpu']:.0f} | {r['mfu_bf16_peak']:.1%} "
        f"| {cell(r.get('mfu_fp8_peak'), '.1%')} | {cell(r.get('peak_gib'), '.1f')} | {r['step_s']:.3f} "
        f"| {cell(r.get('first_step_s'), '.1f')} | {r['loss']:.3f} | {ratio(by.get('plait-bf16'))} "
        f"| {peer['arm'] if peer else ''} | {ratio(peer)} |"
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument(
        "--seq", type=int, default=8192, help="issue 47: 8192 (4096 where memory says so)"
    )
    p.add_argument("--micro", type=int, default=1)
    p.add_argument(
        "--gas", type=int, default=1, help="micro-batches per step (tp/pp arms: 2 x this)"
    )
    p.add_argument("--stage", type=int, default=3, help="plait's ZeRO stage (ds-z3: always 3)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) per arm")
    p.add_argument(
        "--recompute", type=int, default=10**6, help="blocks recomputed in backward (default: all)"
    )
    p.add_argument("--titan-no-cuda-graphs", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=580, help="seconds per arm")
    p.add_argument("--out", default="bench_llama8b.jsonl")
    p.add_argument("--logs", metavar="DIR", help="each arm's output as DIR/ARM.log")
    p.add_argument(
        "--dry-run", action="store_true", help="CPU, llama-tiny, seq 64, every arm at nproc 1 and 2"
    )
    p.add_argument("--report", nargs="+", metavar="JSONL")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.preset, args.seq, args.micro, args.steps, args.warmup = "llama-tiny", 64, 2, 2, 1
    return args


def run_at(nproc: int, arms: list[str], args) -> list[dict]:
    """Every arm at ``nproc`` ranks (``run_arms``); arms that cannot run here become ``not_run`` rows."""
    import json

    names = ("preset", "seq", "micro", "gas", "stage", "recompute", "steps", "warmup")
    child = [x for name in names for x in (f"--{name}", str(getattr(args, name)))]
    child += ["--dry-run"] if args.dry_run else []
    child += ["--titan-no-cuda-graphs"] if args.titan_no_cuda_graphs else []
    launcher = []
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    note = titan_note(nproc)
    if note and any(a.startswith("titan-") for a in arms):
        print(note, flush=True)
    rows, runnable = [], [a for a in arms if not not_runnable(a, nproc)]
    for arm in arms:
        if arm in runnable:
            rows += run_arms(__file__, [arm], args, child, launcher=launcher, tags={"nproc": nproc})
            continue
        row = {"arm": arm, "nproc": nproc, "not_run": not_runnable(arm, nproc)}
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
    return rows


def main():
    args = parse_args()
    if child_or_report(args, measure, report):
        return
    arms = chosen_arms(args, ARMS)
    if args.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on the CPU
    rows = []
    for nproc in (1, 2) if args.dry_run else (args.nproc,):
        rows += run_at(nproc, arms, args)
    print("\n" + report(rows))


if __name__ == "__main__":
    main()
