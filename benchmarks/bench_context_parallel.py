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

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import BETAS, CLIP, LR, PEAK_FLOPS, WEIGHT_DECAY, batch, ds_like_config  # noqa: E402
from _common import _error_line, child_or_report, fsdp2_wrap, known_arms, model_flops_per_token, run_child  # noqa: E402

ARMS = ("plait-cp1", "plait-ring", "plait-a2a", "torch-cp", "torch-cp-repkv", "plait-ring-tiled", "plait-tiled")
THROUGHPUT_ARMS = "plait-cp1,plait-ring,plait-a2a,torch-cp"
LONGEST_ARMS = "plait-ring-tiled,plait-tiled"
CP_METHODS = {"plait-ring": "ring", "plait-a2a": "all_to_all", "plait-ring-tiled": "ring"}


def cp_size(arm: str) -> int:
    """GPUs (= cp ranks) of an arm."""
    return 1 if arm in ("plait-cp1", "plait-tiled") else 2


def model_config(arm: str, model: str, seq: int):
    from bench_long_seq import TILES
    from plait.models import preset
    return preset(model, max_position_embeddings=seq, **(TILES if arm.endswith("tiled") else {}))


def same_batch(cfg, device, step: int, seq: int) -> dict:
    """``_common.batch`` drawn on the CPU (the same on every rank whatever its GPU), then moved to ``device``."""
    return {k: v.to(device) for k, v in batch(cfg, "cpu", step, micro=1, seq=seq).items()}


def plait_arm(arm, cfg, device, seq):
    """plait through ``plait.initialize`` (ZeRO-3, AC of every block), at cp 1 or 2; a step function."""
    import plait
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh
    cp = cp_size(arm)
    conf = ds_like_config(3)
    conf["train_micro_batch_size_per_gpu"] = 1
    conf["activation_checkpointing"] = {"number_checkpoints": cfg.num_layers}   # every block
    if cp == 1:
        model, mesh = TransformerModel(cfg, None, seed=0, device=device), ParallelMesh()
    else:
        mesh = ParallelMesh(cp=cp)
        model = TransformerModel(cfg, mesh, seed=0, device=device, cp_method=CP_METHODS[arm])
        conf["context_parallel"] = {"size": cp, "method": CP_METHODS[arm]}
    engine = plait.initialize(model, conf, mesh=mesh)

    def step(i):
        loss = engine(**same_batch(cfg, device, i, seq))   # whole sequences: the engine keeps this rank's chunks
        engine.backward(loss)
        engine.step()
        return loss
    return step


def torch_cp_arm(arm, cfg, device, seq):
    """HandLlama + FSDP2 + AC under ``torch.distributed.tensor.experimental.context_parallel``; a step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend

    from bench_zero import torch_model
    from hand_llama import Block
    torch.manual_seed(0)
    model, _ = torch_model(cfg, device, ac=True, compiled=False)
    for block in model.modules():
        if isinstance(block, Block):
            block.repeat_kv = arm.endswith("-repkv")
    fsdp2_wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, fused=True)
    group = dist.new_group(list(range(dist.get_world_size())))   # K/V apart from FSDP's collectives
    mesh = DeviceMesh.from_group(group, "cuda", mesh_dim_names=("cp",))
    set_rotate_method("allgather")
    heads, kv, d = cfg.num_heads, cfg.num_heads if arm.endswith("-repkv") else cfg.num_kv_heads, cfg.head_dim
    q, k = (torch.empty(1, n, seq // 2, d, device=device, dtype=torch.bfloat16) for n in (heads, kv))
    choice = torch._fused_sdp_choice(q, k, k, None, 0.0, True, enable_gqa=heads != kv)
    print(f"torch-cp: SDPA picks {SDPBackend(choice).name} for this rank's q {list(q.shape)}, k {list(k.shape)}",
          flush=True)

    def step(i):
        b = same_batch(cfg, device, i, seq)
        # buffers of their own storage: context_parallel shards them in place (resize_ + copy_)
        ids, labels = b["input_ids"].clone(), b["labels"].clone()
        pos = torch.arange(seq, device=device).unsqueeze(0)
        buffers = [ids, labels, pos]
        with context_parallel(
                mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            loss = model(ids, labels, position_ids=pos)   # this rank's mean; FSDP averages the 2 ranks' grads
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def run_arm(arm: str, args) -> dict:
    """On every rank: one warm-up step, ``--steps`` timed steps; rank 0 returns the row."""
    import torch.distributed as dist

    from bench_zero import init_distributed
    torch.backends.cuda.matmul.allow_tf32 = True
    device, seq = init_distributed(), args.seq
    cfg = model_config(arm, args.model, seq)
    step = (torch_cp_arm if arm.startswith("torch-") else plait_arm)(arm, cfg, device, seq)
    t0 = time.perf_counter()
    step(0)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        loss = step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    world, cp = dist.get_world_size(), cp_size(arm)
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    total = loss.detach().float().clone()
    dist.all_reduce(total)   # the mean over the ranks (plait: each rank's is the sequence's; torch: its shard's)
    n = cfg.num_parameters()
    tokens_gpu = seq * (world // cp) / dt / world        # one sequence per dp rank per step, over all GPUs
    return {"arm": arm, "model": args.model, "nproc": world, "cp": cp, "seq": seq, "tokens_per_s_gpu": tokens_gpu,
            "mfu": tokens_gpu * model_flops_per_token(cfg, n, seq) / PEAK_FLOPS, "peak_gib": peak.item() / 2**30,
            "step_s": dt, "warmup_s": first, "loss": total.item() / world, "params": n, "steps": args.steps,
            "device": torch.cuda.get_device_name(device), "torch": torch.__version__}


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
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp_size(arm))]
    name = f"{arm}-{seq}"
    log = os.path.join(args.logs, f"{name}.log") if args.logs else f"{args.out}.{name}.log"
    child = ["--model", args.model, "--seq", str(seq), "--steps", str(args.steps)]
    row = run_child(__file__, arm, child, args.timeout, log_path=log, launcher=launcher)
    rank_error(row, log)
    row.update({k: v for k, v in {"model": args.model, "nproc": cp_size(arm), "cp": cp_size(arm), "seq": seq,
                                  **tags}.items() if k not in row})
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
    return (f"{r['tokens_per_s_gpu'] / 1e3:.2f}k | {100 * r['mfu']:.1f}% | {r['peak_gib']:.2f} | "
            f"{r['step_s']:.3f} | {r['loss']:.4f}")


def heading(rows, what: str) -> str:
    ok = [r for r in rows if "device" in r]
    about = (f"{ok[0]['params'] / 1e9:.2f}B parameters; {ok[0]['device']}; torch {ok[0]['torch']}" if ok
             else "no row ran")
    return (f"{rows[0].get('model')} ({about}), {what}: one sequence per step (micro-batch 1, dp 1), bf16, "
            "AdamW, clip 1.0, activation checkpointing per block; plait ZeRO-3, torch FSDP2")


def throughput_table(rows, L) -> list[str]:
    by = {r["arm"]: r for r in rows if "device" in r}
    torch_cp, cp1 = by.get("torch-cp"), by.get("plait-cp1")
    out = [heading(rows, f"cp=1 at seq {L}, cp=2 at seq {2 * L}"), "",
           "| arm | GPUs | seq | tokens/s/GPU | MFU | peak GiB | step s | loss | x torch-cp | scaling (tok/s/GPU) "
           "| scaling (MFU) |", "|---" * 11 + "|"]
    for r in rows:
        head = f"| {r['arm']} | {r.get('nproc', '')} | {r.get('seq', '')} | "
        if "error" in r:
            out.append(head + f"failed: {r['error'][:300].replace('|', '/')} | | | | | | | |")
            continue
        two = r["cp"] == 2
        out.append(head + cells(r) + f" | {ratio(r, torch_cp) if two else ''} | {ratio(r, cp1) if two else ''} | "
                   f"{ratio(r, cp1, 'mfu') if two else ''} |")
    return out + ["", "x torch-cp: tokens/s/GPU over torch-cp's; scaling: a cp=2 row's tokens/s/GPU (or MFU) at "
                  f"seq {2 * L} over plait-cp1's at seq {L}.", ""]


def longest_table(rows) -> list[str]:
    out = [heading(rows, "the longest sequence that trains (loss and MLP in tiles of 4096 tokens)"), "",
           "| arm | GPUs | seq | tokens/s/GPU | MFU | peak GiB | step s | loss |", "|---" * 8 + "|"]
    best = {}
    for r in rows:
        head = f"| {r['arm']} | {r.get('nproc', '')} | {r['seq']} | "
        if "error" in r:
            out.append(head + f"failed: {r['error'][:200].replace('|', '/')} | | | | |")
            continue
        out.append(head + cells(r) + " |")
        best[r["arm"]] = max(best.get(r["arm"], 0), r["seq"])
    out += [""] + [f"- {arm} (cp={cp_size(arm)}): longest that trained {seq:,} tokens" for arm, seq in best.items()]
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", help=f"default {THROUGHPUT_ARMS} (with --longest: {LONGEST_ARMS}); any of "
                                  f"{','.join(ARMS)}")
    p.add_argument("--model", default="llama-886m", help="a plait Llama preset")
    p.add_argument("--L", type=int, default=32768, help="sequence at cp=1; cp=2 arms train 2 x L")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--longest", action="store_true", help="each arm over --seqs until its first failure")
    p.add_argument("--seqs", default="131072,196608,262144,393216,524288", help="with --longest: whole sequences")
    p.add_argument("--timeout", type=float, default=600, help="seconds per (arm, seq)")
    p.add_argument("--out", default="bench_context_parallel.jsonl")
    p.add_argument("--logs", metavar="DIR", help="each child's output as DIR/ARM-SEQ.log (default: OUT.ARM-SEQ.log)")
    p.add_argument("--report", nargs="+", metavar="JSONL", help="print the tables of earlier runs and exit")
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
        rows = [run_row(arm, args.L * cp_size(arm), args, {"mode": "throughput", "L": args.L}) for arm in arms]
    print("\n" + report(rows))


if __name__ == "__main__":
    main()
