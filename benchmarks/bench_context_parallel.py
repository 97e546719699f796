"""Issue 16: context parallelism on 2 GPUs of one machine: plait's ring and all-to-all against torch's own.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/bench_context_parallel.py [--L 32768] [--steps 3]
        [--arms plait-cp1,plait-ring,plait-a2a,torch-cp] [--timeout 600] [--out bench_cp.jsonl] [--logs DIR]
    python benchmarks/bench_context_parallel.py --longest [--arms plait-ring-tiled,plait-tiled]
        [--seqs 131072,196608,262144,393216,524288] [--steps 1] [--out ...]
    python benchmarks/bench_context_parallel.py --report a.jsonl b.jsonl     # tables of earlier runs, together

Each (arm, sequence length) runs under ``torch.distributed.run --standalone --nproc-per-node N`` (N: the
arm's cp size) in a process group of its own (a failure, e.g. CUDA out of memory, or a run past --timeout
becomes a row with its error). Every arm trains llama-886m (``plait.models.preset("llama-886m",
max_position_embeddings=seq)``) on one sequence per step (micro-batch 1, data parallel 1), bf16, AdamW
(lr 1e-4, wd 0.1, betas 0.9/0.95), clipping 1.0, activation checkpointing of every block: one warm-up step,
then --steps timed steps. Every rank draws the same batch (token ids seeded by the step, drawn on the CPU);
labels are the next tokens, aligned to positions (``_common.batch``: neither model shifts them).

- plait-cp1 (1 GPU, seq L): ``TransformerModel(cfg, None)`` through ``plait.initialize`` with
  ``_common.ds_like_config(3)`` (ZeRO-3) and ``activation_checkpointing`` of every block.
- plait-ring / plait-a2a (2 GPUs, seq 2L): the same with ``ParallelMesh(cp=2)``, the model built with
  ``cp_method`` "ring" / "all_to_all" and ``context_parallel: {size: 2, method}`` in the config; the engine
  gets whole sequences and keeps each rank's two zigzag chunks (``plait.parallel.context.shard_sequence``).
- torch-cp (2 GPUs, seq 2L): ``hand_llama.HandLlama`` at the same shape (same parameter count), each block in
  ``checkpoint_wrapper``, ``fully_shard`` per block and on the root over the 2 ranks (bf16 parameters, fp32
  reduce; ``_common.fsdp2_wrap``), fused torch AdamW, under torch's
  ``torch.distributed.tensor.experimental.context_parallel`` on a 1-d mesh of its own process group (as
  torchtitan's cp mesh, apart from FSDP's): input_ids, labels and position_ids are its buffers (sequence dim
  1), sharded head-tail (torch's load balancing, on by default: rank r holds chunks r and 2cp-1-r, plait's
  zigzag), and RoPE takes each token's global position (``HandLlama.forward(position_ids=...)``). SDPA runs
  the kernel it picks itself (cuDNN on an H100 where it applies; the log names it), as plait's ring blocks
  do (``plait.parallel.context._cuda_kernel``). K/V rotate by
  ``set_rotate_method("allgather")``, torch's and torchtitan's default: at cp=2 it moves the same bytes as
  "alltoall" (each rank receives the other's K/V once per attention call), posted before the first block
  is computed. Grouped-query attention (16 heads on 8 kv heads) goes in as ``enable_gqa=True``: torch's CP
  handler runs the fused kernel on the local K/V as they are (the kernel takes fewer kv heads, its backward
  returns kv-head gradients, which the ring accumulates in K/V's shape), so K/V travel with 8 heads, as
  plait's. torch-cp-repkv (not run by default; a fallback should that fail): each block repeats K/V to all
  16 heads before SDPA (``Block.repeat_kv``; torchtitan's Llama does this), so twice the K/V bytes travel.
- --longest: plait-ring-tiled (2 GPUs) and plait-tiled (1 GPU) over --seqs (the whole sequence's length),
  ``fused_loss_chunk_tokens`` and ``mlp_chunk_tokens`` 4096 (``bench_long_seq.TILES``), else as plait-ring /
  plait-cp1; an arm stops at its first failure: the longest sequence that trains at cp=2 and at cp=1.

Reported per row: tokens/s per GPU (the tokens of one step over all ranks, seq x micro 1 x dp 1, / step
time / GPUs), MFU = tokens/s/GPU x (6N + 6 x layers x hidden x seq) / 989e12 (``_common``), peak GiB (the
largest ``torch.cuda.max_memory_allocated`` over the ranks, over the timed steps), the last step's loss
(mean over the sequence). Tables: plait-ring and plait-a2a against torch-cp (tokens/s/GPU), and the scaling
efficiency tokens/s/GPU(cp=2, seq 2L) / tokens/s/GPU(plait-cp1, seq L) (with the MFU ratio beside it: the
attention flops per token double with the sequence, so 1.0 tokens/s/GPU is not the ideal).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import _error_line, child_or_report, known_arms, run_child  # noqa: E402
from _cp_arms import cp_size, run_arm  # noqa: E402

ARMS = (
    "plait-cp1",
    "plait-ring",
    "plait-a2a",
    "torch-cp",
    "torch-cp-repkv",
    "plait-ring-tiled",
    "plait-tiled",
)
THROUGHPUT_ARMS = "plait-cp1,plait-ring,plait-a2a,torch-cp"
LONGEST_ARMS = "plait-ring-tiled,plait-tiled"


def rank_error(row: dict, log: str) -> None:
    """torchrun ends a failed run with its own ChildFailedError: name the rank's exception (e.g. CUDA out of
    memory) from the child's output instead."""
    if "ChildFailedError" not in row.get("error", ""):
        return
    with open(log) as f:
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", x) for x in f.read().splitlines()]
    found = _error_line("\n".join(x for x in lines if "ChildFailedError" not in x))
    row["error"] = f"{row['error'].split(':')[0]}: {found}"


def run_row(arm: str, seq: int, args, tags: dict) -> dict:
    """One (arm, seq) in its own ``torch.distributed.run`` group; the row, appended to --out and printed."""
    t0 = time.perf_counter()
    launcher = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(cp_size(arm)),
    ]
    name = f"{arm}-{seq}"
    log = os.path.join(args.logs, f"{name}.log") if args.logs else f"{args.out}.{name}.log"
    child = ["--model", args.model, "--seq", str(seq), "--steps", str(args.steps)]
    row = run_child(__file__, arm, child, args.timeout, log_path=log, launcher=launcher)
    rank_error(row, log)
    row.update(
        {
            k: v
            for k, v in {
                "model": args.model,
                "nproc": cp_size(arm),
                "cp": cp_size(arm),
                "seq": seq,
                **tags,
            }.items()
            if k not in row
        }
    )
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def ratio(row, base, key="tokens_per_s_gpu") -> str:
    if base is None or key not in row or key not in base:
        return ""
    return f"{row[key] / base[key]:.3f}"


def cells(r) -> str:
    return (
        f"{r['tokens_per_s_gpu'] / 1e3:.2f}k | {100 * r['mfu']:.1f}% | {r['peak_gib']:.2f} | "
        f"{r['step_s']:.3f} | {r['loss']:.4f}"
    )


def heading(rows, what: str) -> str:
    ok = [r for r in rows if "device" in r]
    about = (
        f"{ok[0]['params'] / 1e9:.2f}B parameters; {ok[0]['device']}; torch {ok[0]['torch']}"
        if ok
        else "no row ran"
    )
    return (
        f"{rows[0].get('model')} ({about}), {what}: one sequence per step (micro-batch 1, dp 1), bf16, "
        "AdamW, clip 1.0, activation checkpointing per block; plait ZeRO-3, torch FSDP2"
    )


def throughput_table(rows, L) -> list[str]:
    by = {r["arm"]: r for r in rows if "device" in r}
    torch_cp, cp1 = by.get("torch-cp"), by.get("plait-cp1")
    out = [
        heading(rows, f"cp=1 at seq {L}, cp=2 at seq {2 * L}"),
        "",
        "| arm | GPUs | seq | tokens/s/GPU | MFU | peak GiB | step s | loss | x torch-cp | scaling (tok/s/GPU) "
        "| scaling (MFU) |",
        "|---" * 11 + "|",
    ]
    for r in rows:
        head = f"| {r['arm']} | {r.get('nproc', '')} | {r.get('seq', '')} | "
        if "error" in r:
            out.append(head + f"failed: {r['error'][:300].replace('|', '/')} | | | | | | | |")
            continue
        two = r["cp"] == 2
        out.append(
            head
            + cells(r)
            + f" | {ratio(r, torch_cp) if two else ''} | {ratio(r, cp1) if two else ''} | "
            f"{ratio(r, cp1, 'mfu') if two else ''} |"
        )
    return out + [
        "",
        "x torch-cp: tokens/s/GPU over torch-cp's; scaling: a cp=2 row's tokens/s/GPU (or MFU) at "
        f"seq {2 * L} over plait-cp1's at seq {L}.",
        "",
    ]


def longest_table(rows) -> list[str]:
    out = [
        heading(rows, "the longest sequence that trains (loss and MLP in tiles of 4096 tokens)"),
        "",
        "| arm | GPUs | seq | tokens/s/GPU | MFU | peak GiB | step s | loss |",
        "|---" * 8 + "|",
    ]
    best = {}
    for r in rows:
        head = f"| {r['arm']} | {r.get('nproc', '')} | {r['seq']} | "
        if "error" in r:
            out.append(head + f"failed: {r['error'][:200].replace('|', '/')} | | | | |")
            continue
        out.append(head + cells(r) + " |")
        best[r["arm"]] = max(best.get(r["arm"], 0), r["seq"])
    out += [""] + [
        f"- {arm} (cp={cp_size(arm)}): longest that trained {seq:,} tokens"
        for arm, seq in best.items()
    ]
    return out + [""]


def report(rows) -> str:
    """Markdown: one throughput table per (model, L), then the longest-sequence rows per model."""
    out = []
    keys = []
    for r in rows:
        key = (r.get("mode"), r.get("model"), r.get("L"))
        if key not in keys:
            keys.append(key)
    for mode, model, L in keys:
        group = [r for r in rows if (r.get("mode"), r.get("model"), r.get("L")) == (mode, model, L)]
        out += throughput_table(group, L) if mode == "throughput" else longest_table(group)
    return "\n".join(out)


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--arms",
        help=f"default {THROUGHPUT_ARMS} (with --longest: {LONGEST_ARMS}); any of {','.join(ARMS)}",
    )
    p.add_argument("--model", default="llama-886m", help="a plait Llama preset")
    p.add_argument("--L", type=int, default=32768, help="sequence at cp=1; cp=2 arms train 2 x L")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument(
        "--longest", action="store_true", help="each arm over --seqs until its first failure"
    )
    p.add_argument(
        "--seqs",
        default="131072,196608,262144,393216,524288",
        help="with --longest: whole sequences",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per (arm, seq)")
    p.add_argument("--out", default="bench_context_parallel.jsonl")
    p.add_argument(
        "--logs",
        metavar="DIR",
        help="each child's output as DIR/ARM-SEQ.log (default: OUT.ARM-SEQ.log)",
    )
    p.add_argument(
        "--report", nargs="+", metavar="JSONL", help="print the tables of earlier runs and exit"
    )
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    return p.parse_args()


def main():
    args = parse_args()
    if child_or_report(args, run_arm, report):
        return
    arms = known_arms((args.arms or (LONGEST_ARMS if args.longest else THROUGHPUT_ARMS)), ARMS)
    for folder in (args.logs, os.path.dirname(args.out)):
        if folder:
            os.makedirs(folder, exist_ok=True)
    rows = []
    if args.longest:
        for arm in arms:
            for seq in (int(s) for s in args.seqs.split(",")):
                rows.append(run_row(arm, seq, args, {"mode": "longest"}))
                if "error" in rows[-1]:
                    break
    else:
        rows = [
            run_row(arm, args.L * cp_size(arm), args, {"mode": "throughput", "L": args.L})
            for arm in arms
        ]
    print("\n" + report(rows))


if __name__ == "__main__":
    main()
