"""Pipeline schedules on GPUs: measured step time and bubble beside the simulator's prediction.

    torchrun --nproc-per-node 2 benchmarks/bench_pipeline.py [--schedules 1f1b,interleaved,zb-h1,zb-v]
        [--micro-batches 8,16] [--micro-batch-sizes 1,2] [--timelines FILE] [--label NAME]
        [--cuda-graphs off|on|both]

Model: llama-886m (ANCHORS.md; 16 blocks) in bf16, sequence 2048, pp = world size.
Per configuration: 2 warm-up and --steps timed ``train_batch`` calls (forward + backward, no
optimizer). The executor times each compute action with CUDA events (``PipelineExecutor.timeline``):
busy = the summed action time of the busiest rank; measured bubble = step / busy - 1 (idle over useful
time, the simulator's definition). Simulated bubble: ``plait.parallel.pipeline.simulate`` on the schedule's
lists with the measured median F/B/BI/BW times of each virtual stage, so the gap between the two is what
the executor itself loses (transfers, waits, host stalls). A "zb-v*" row follows each zb-v row: the same
scheduler planned for the stage times zb-v just measured; its engine arms plan for their own second step
(``schedule_costs="measure"``), as a user's run would. Also printed per rank: each action kind's count per step,
device ms and host ms to issue it, and F/B/BI/BW timed in isolation (BI + BW against B: the split
backward's cost). Prints a markdown table on rank 0 and appends JSON lines to --out.
``--cuda-graphs both`` runs every row eagerly and then with ``PipelineParallel(cuda_graphs=True)`` (rows
"<schedule>+g"; their ZeRO-3 engine arms are not run: graphs need resident parameters).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_jsonl  # noqa: E402
from _pipeline_timing import breakdown, close, engine_step_time, predicted_bubble, profile_step  # noqa: E402
from _pipeline_timing import run_config, timed_chunks  # noqa: E402


def p2p_knobs(ctas: int | None, lookahead: int | None, gc_pause: bool = True) -> None:
    """Experiment knobs (this benchmark only): create the pipeline's p2p channel groups with NCCL's
    ``max_ctas`` (SMs each p2p kernel may occupy while it overlaps compute), place receives
    ``lookahead`` compute actions ahead of their reader (``comm_actions.with_communication``), and leave
    the cyclic garbage collector running during steps (``gc_pause=False``)."""
    import functools
    import types

    import plait.parallel.pipeline.executor as pipeline_exec

    if not gc_pause and hasattr(pipeline_exec, "gc"):
        pipeline_exec.gc = types.SimpleNamespace(
            isenabled=lambda: False, disable=lambda: None, enable=lambda: None
        )

    import plait.parallel.pipeline.p2p as p2p
    import plait.parallel.pipeline.parallel as pipeline

    if ctas:
        new_group = dist.new_group

        def limited(ranks, **kw):
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.max_ctas = ctas
            opts.config.min_ctas = 1
            return new_group(ranks, pg_options=opts, **kw)

        wrapped = p2p.channel_groups

        def channel_groups(mesh):
            dist.new_group = limited
            try:
                return wrapped(mesh)
            finally:
                dist.new_group = new_group

        pipeline.channel_groups = channel_groups
    if lookahead is not None:
        pipeline.with_communication = functools.partial(
            pipeline.with_communication, lookahead=lookahead
        )


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedules", default="1f1b,interleaved,zb-h1,zb-v")
    parser.add_argument("--micro-batches", default="8,16", help="m values, comma-separated")
    parser.add_argument(
        "--micro-batch-sizes", default="1", help="sequences per micro-batch, comma-separated"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="bench_pipeline.jsonl")
    parser.add_argument(
        "--timelines", default=None, help="write every rank's per-action timeline here (JSON)"
    )
    parser.add_argument("--label", default="plait", help="name of this code version in the table")
    parser.add_argument("--preset", default="llama-886m")
    parser.add_argument(
        "--layers", type=int, default=None, help="blocks instead of the preset's number"
    )
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--p2p-ctas", type=int, default=None, help="NCCL max_ctas of the p2p groups (experiment)"
    )
    parser.add_argument(
        "--p2p-lookahead", type=int, default=None, help="receives this many actions ahead"
    )
    parser.add_argument(
        "--no-gc-pause", action="store_true", help="keep the cyclic GC running in steps"
    )
    parser.add_argument(
        "--profile",
        default="",
        help="profile one more step of these configs, e.g. "
        "zb-h1/m8/b1,1f1b/m8/b1; tables go to --out with .profile.txt",
    )
    parser.add_argument(
        "--no-plan",
        dest="plan",
        action="store_false",
        help="skip the zb-v row planned for the measured stage times (zb-v*)",
    )
    parser.add_argument(
        "--cuda-graphs",
        default="off",
        choices=("off", "on", "both"),
        help="replay the actions as CUDA graphs (PipelineParallel(cuda_graphs=True)); "
        "both: each row twice",
    )
    parser.add_argument(
        "--engine", default="", help="ZeRO stages to also time through engine.train_batch, e.g. 1,3"
    )
    return parser.parse_args()


def measure(
    args,
    cfg,
    mesh,
    chunks,
    schedule,
    v,
    m,
    mbs,
    make_batch,
    isolated,
    timelines,
    costs=None,
    graphs=False,
) -> dict:
    """One (schedule, m, micro-batch size) row: raw train_batch timing, every rank's action breakdown, the
    simulator's bubble on the measured times, and the engine arms. ``costs``: zb-v planned for these
    per-stage times (the row's schedule is then "zb-v*"); ``graphs``: CUDA-graphed actions ("+g")."""
    from plait.parallel.pipeline.parallel import PipelineParallel
    from plait.parallel.pipeline.simulate import stage_costs

    p = mesh.pp
    pipe = PipelineParallel(
        chunks, mesh, schedule=schedule, micro_batches=m, schedule_costs=costs, cuda_graphs=graphs
    )
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    step_s, tls, busy_s = run_config(pipe, chunks, make_batch, m, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    name = schedule + ("*" if costs else "") + ("+g" if graphs else "")
    key = f"{name}/m{m}/b{mbs}"
    if key in args.profile.split(","):
        profile_step(pipe, chunks, make_batch, m, f"{args.out}.{schedule}-m{m}-b{mbs}.profile.txt")
    mine = {
        "busy": busy_s,
        "peak_gib": peak,
        "kinds": breakdown([t for tl in tls for t in tl], len(tls)),
        "isolated": isolated,
        "actions": [t.__dict__ for tl in tls for t in tl],
    }
    every = [None] * p
    dist.all_gather_object(every, mine)
    busy = max(e["busy"] for e in every)
    timelines[key] = [[t.__dict__ for t in tls[-1]]] if tls else []
    measured = stage_costs([e.pop("actions") for e in every], p, v, pipe.shape)
    close(pipe)
    row = {
        "label": args.label,
        "schedule": name,
        "p": p,
        "v": v,
        "m": m,
        "micro_batch": mbs,
        "step_s": step_s,
        "busy_s": busy,
        "tokens_per_s": m * mbs * args.seq / step_s,
        "peak_gib": max(e["peak_gib"] for e in every),
        "bubble_measured": step_s / busy - 1 if busy else None,
        "bubble_simulated": predicted_bubble(pipe.lists, p, v, pipe.shape, measured)
        if measured
        else None,
        "stage_costs_ms": {k: [1e3 * x for x in c] for k, c in measured.items()},
        "ranks": every,
    }
    del pipe  # its graphs' memory pools
    gc.collect()
    for stage in [int(x) for x in args.engine.split(",") if x and not (graphs and int(x) == 3)]:
        row[f"engine_zero{stage}_step_s"] = engine_step_time(
            cfg, mesh, schedule, v, m, mbs, stage, make_batch, args.steps, costs, graphs
        )
    return row


def main():
    from plait.models import preset
    from plait.layers.stages import build_stage_modules
    from plait.parallel import ParallelMesh, init_distributed

    args = parse_args()
    info = init_distributed()
    p2p_knobs(args.p2p_ctas, args.p2p_lookahead, not args.no_gc_pause)
    mesh = ParallelMesh(tp=1, pp=info.world_size)
    device = mesh.device
    cfg = preset(
        args.preset,
        max_position_embeddings=max(args.seq, 2048),
        **({"num_layers": args.layers} if args.layers else {}),
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, timelines = [], {}
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graphs]
    for schedule in args.schedules.split(","):
        v = 2 if schedule in ("interleaved", "zb-v") else 1
        chunks = build_stage_modules(
            cfg, mesh, v=v, seed=0, device=device, dtype=dtype, schedule=schedule
        )
        gen = torch.Generator(device=device).manual_seed(mesh.pp_rank)
        for mbs in [int(x) for x in args.micro_batch_sizes.split(",")]:

            def make_batch():
                ids = torch.randint(
                    0, cfg.vocab_size, (mbs, args.seq + 1), device=device, generator=gen
                )
                return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

            isolated = timed_chunks(
                chunks, make_batch, (mbs, args.seq, cfg.hidden_size), dtype, device
            )
            for m, graphs in [(int(x), g) for x in args.micro_batches.split(",") for g in modes]:
                new = [
                    measure(
                        args,
                        cfg,
                        mesh,
                        chunks,
                        schedule,
                        v,
                        m,
                        mbs,
                        make_batch,
                        isolated,
                        timelines,
                        graphs=graphs,
                    )
                ]
                if (
                    schedule == "zb-v" and args.plan
                ):  # again, planned for the stage times just measured
                    costs = {k: new[0]["stage_costs_ms"][k] for k in ("F", "BI", "BW")}
                    new.append(
                        measure(
                            args,
                            cfg,
                            mesh,
                            chunks,
                            schedule,
                            v,
                            m,
                            mbs,
                            make_batch,
                            isolated,
                            timelines,
                            costs,
                            graphs,
                        )
                    )
                rows += new
                for row in new if info.rank == 0 else []:
                    print(json.dumps({k: x for k, x in row.items() if k != "ranks"}), flush=True)
        del chunks
    if args.timelines:
        gathered = [None] * mesh.pp
        dist.all_gather_object(gathered, timelines)
        if info.rank == 0:
            with open(args.timelines, "w") as f:
                json.dump({k: [g[k] for g in gathered] for k in timelines}, f)
    if info.rank == 0:
        report(rows, args, mesh.pp, dtype)
    dist.destroy_process_group()


def report(rows, args, p, dtype):
    write_jsonl(args.out, rows, append=True)
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(
        f"\n{args.preset} {dtype}, seq {args.seq}, pp={p} on {where}; torch {torch.__version__}; {args.label}"
    )
    print(
        "| code | schedule | m | micro-batch | step s | tokens/s | bubble measured | simulated | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bm = "n/a" if r["bubble_measured"] is None else f"{100 * r['bubble_measured']:.1f}%"
        bs = "n/a" if r["bubble_simulated"] is None else f"{100 * r['bubble_simulated']:.1f}%"
        print(
            f"| {r['label']} | {r['schedule']}{' v=2' if r['v'] == 2 else ''} | {r['m']} | {r['micro_batch']} | "
            f"{r['step_s']:.3f} | {r['tokens_per_s'] / 1e3:.1f}k | {bm} | {bs} | {r.get('peak_gib', 0):.2f} |"
        )
    engine = sorted({k for r in rows for k in r if k.startswith("engine_")})
    if engine:
        print("\nthrough engine.train_batch (bf16, AdamW step), tokens/s:")
        print("| code | schedule | m | micro-batch | " + " | ".join(k[7:-7] for k in engine) + " |")
        print("|---|---|---|---|" + "---|" * len(engine))
        for r in rows:
            tok = r["m"] * r["micro_batch"] * args.seq
            print(
                f"| {r['label']} | {r['schedule']} | {r['m']} | {r['micro_batch']} | "
                + " | ".join(f"{tok / r[k] / 1e3:.1f}k" if k in r else "-" for k in engine)
                + " |"
            )
    print("\nper action (rank: kind n/step, device ms, host ms; isolated F/B/BI/BW ms)")
    for r in rows:
        for rank, e in enumerate(r["ranks"]):
            kinds = " ".join(
                f"{k}:{x['n']:.0f}x{x['gpu_ms']:.2f}/{x['host_ms']:.2f}"
                for k, x in e["kinds"].items()
            )
            iso = "/".join(f"{1e3 * e['isolated'][k]:.2f}" for k in ("F", "B", "BI", "BW"))
            print(
                f"{r['label']} {r['schedule']} m={r['m']} b={r['micro_batch']} rank {rank}: {kinds}; isolated {iso}"
            )


if __name__ == "__main__":
    main()
