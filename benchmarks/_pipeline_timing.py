"""How bench_pipeline.py times a pipeline: F/B/BI/BW of the chunks in isolation, ``train_batch`` steps with the
executor's per-action timeline, one step under torch.profiler, the engine arms (ZeRO + AdamW), and the
simulator's bubble for the measured stage times."""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_chunks(chunks, make_batch, shape, dtype, device, warmup=3, reps=8):
    """Mean seconds of F, B, BI and BW for this rank's chunks on one micro-batch, timed in isolation (no
    communication) after ``warmup`` untimed repetitions; BI + BW against B is the split backward's cost."""
    from plait.parallel.pipeline.backward import backward_input, backward_weight

    total = dict.fromkeys(("F", "B", "BI", "BW"), 0.0)
    for rep in range(warmup + reps):
        for split in (False, True):
            for chunk in chunks:
                batch = make_batch()
                x = (
                    None
                    if 0 in chunk.layer_indices
                    else torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                )
                sync()
                t0 = time.perf_counter()
                out = chunk(hidden=x, **batch)
                sync()
                t1 = time.perf_counter()
                grad = None if out.dim() == 0 else torch.ones_like(out)
                if split:
                    _, pending = backward_input(out, grad, x)
                    del out
                    sync()
                    t2 = time.perf_counter()
                    backward_weight(pending)
                    parts = {"BI": t2 - t1}
                else:
                    torch.autograd.backward(out, grad)
                    parts = {"F": t1 - t0}
                sync()
                parts["BW" if split else "B"] = time.perf_counter() - (t2 if split else t1)
                if rep >= warmup:
                    for k, t in parts.items():
                        total[k] += t / reps
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    return total


def breakdown(timeline, steps) -> dict:
    """Per action kind: count per step, mean device ms and mean host ms to issue it."""
    out = {}
    for kind in ("F", "B", "BI", "BW"):
        acts = [t for t in timeline if t.kind == kind]
        if acts:
            out[kind] = {
                "n": len(acts) / steps,
                "gpu_ms": 1e3 * sum(t.end - t.start for t in acts) / len(acts),
                "host_ms": 1e3 * sum(t.host for t in acts) / len(acts),
            }
    return out


def profile_step(pipe, chunks, make_batch, m, path):
    """One more ``train_batch`` under torch.profiler; this rank's top host ops (self CPU time) and top
    kernels are appended to ``path``, its Chrome trace written beside it."""
    from torch.profiler import ProfilerActivity, profile

    batches = [make_batch() for _ in range(m)]
    sync()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pipe.train_batch(iter(batches))
        sync()
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    prof.export_chrome_trace(f"{path}.rank{dist.get_rank()}.trace.json")
    with open(path, "a") as f:
        f.write(f"\n== rank {dist.get_rank()}\n{table}\n")


def timed_steps(train_batch, make_batch, m, steps, after_step=None):
    """Seconds of each of ``steps`` ``train_batch(iter(m batches))`` calls after 2 warm-ups, every rank
    synchronized around each; ``after_step(timed)`` runs after every call."""
    times = []
    for step in range(2 + steps):
        batches = [make_batch() for _ in range(m)]
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        train_batch(iter(batches))
        sync()
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - t0)
        if after_step is not None:
            after_step(step >= 2)
    return times


def run_config(pipe, chunks, make_batch, m, steps):
    """Time ``steps`` train_batch calls after 2 warm-ups; returns (mean step s, this rank's timelines,
    mean busy s)."""
    pipe.executor.time_compute = True
    timelines, busy = [], []

    def record(timed):
        if timed:
            timelines.append(list(getattr(pipe.executor, "timeline", [])))
            busy.append(pipe.executor.busy_seconds)
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)

    times = timed_steps(pipe.train_batch, make_batch, m, steps, record)
    return sum(times) / len(times), timelines, sum(busy) / len(busy)


def close(pipe) -> None:
    """``pipe.close()`` where the plait under test has it (a BASELINE tree may predate it)."""
    getattr(pipe, "close", lambda: None)()


def engine_step_time(
    cfg, mesh, schedule, v, m, mbs, stage, make_batch, steps, costs=None, graphs=False
):
    """Mean seconds of ``engine.train_batch`` (forward, backward, ZeRO reduction, AdamW step) for a fresh
    engine over new stage chunks: bf16 with float32 master weights, ZeRO ``stage``, after 2 warm-ups.
    ``costs`` (zb-v*): plan for the engine's own measured second step instead of unit costs; ``graphs``: the
    pipeline's actions as CUDA graphs."""
    import plait
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline.parallel import PipelineParallel

    gc.collect()  # the previous arm's engine (reference cycles) must free its memory first
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    chunks = build_stage_modules(cfg, mesh, v=v, seed=0, device=mesh.device, schedule=schedule)
    pipe = PipelineParallel(
        chunks,
        mesh,
        schedule=schedule,
        micro_batches=m,
        virtual_stages=v,
        schedule_costs="measure" if costs else None,  # planned in the second warm-up
        cuda_graphs=graphs,
    )
    config = {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": m,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "pipeline": {"size": mesh.pp, "schedule": schedule, "virtual_stages": v},
    }
    engine = plait.initialize(pipe, config, mesh=mesh)
    times = timed_steps(engine.train_batch, make_batch, m, steps)
    close(pipe)  # its NCCL communicators hold device memory
    del engine, pipe, chunks
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return sum(times) / len(times)


def predicted_bubble(lists, p, v, shape, costs):
    """The simulator's bubble for ``lists`` with the measured median action times per virtual stage
    (``plait.parallel.pipeline.simulate.stage_costs``: a rank's chunks differ, e.g. the first stage's BI is empty)."""
    from plait.parallel.pipeline.simulate import simulate

    sim = simulate(
        lists,
        p,
        v,
        cost_f=costs.get("F", 0.0),
        cost_b=costs.get("B", 0.0),
        cost_bi=costs.get("BI", 0.0),
        cost_bw=costs.get("BW", 0.0),
        shape=shape,
    )
    return sim.makespan / max(sim.busy) - 1
