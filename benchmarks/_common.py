"""Helpers shared by bench_llama_zero.py and bench_compile.py: the llama-886m training setup (sequence
2048, micro-batch 4, AdamW lr 1e-4 wd 0.1 betas 0.9/0.95, clip 1.0), the ds_config both plait and
DeepSpeed read, one-process distributed init, and running each arm in a child process of its own.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time

import torch

SEQ, MICRO = 2048, 4
PEAK_FLOPS = 989e12  # bf16 dense peak of H100/H200 SXM (ANCHORS.md)
LR, WEIGHT_DECAY, BETAS, CLIP = 1e-4, 0.1, (0.9, 0.95), 1.0


def write_jsonl(path: str, rows: list[dict], append: bool = False) -> None:
    """One JSON object per line (the raw rows every benchmark keeps under ``benchmarks/results/``)."""
    with open(path, "a" if append else "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def model_flops_per_token(cfg, n_params: int, seq: int = SEQ) -> float:
    """6N + 6 x layers x hidden x seq (attention scores counted once, as ANCHORS.md)."""
    return 6 * n_params + 6 * cfg.num_layers * cfg.hidden_size * seq


def palm_flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs of one trained token as torchtitan counts them for its published MFU (``get_num_flop_per_token``;
    PaLM, Chowdhery et al. 2022, appendix B): ``6 N + 12 L h s``, N the parameters without the input embedding.
    :func:`model_flops_per_token` is ANCHORS.md's count for plait's own tables; this one compares with
    torchtitan's figures (issue 47)."""
    non_embedding = cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size
    return 6 * non_embedding + 12 * cfg.num_layers * cfg.hidden_size * seq


def batch(cfg, device, step, micro: int = MICRO, seq: int = SEQ) -> dict:
    """Random token ids (seeded by ``step``): ``input_ids`` and next-token ``labels``, ``[micro, seq]``."""
    g = torch.Generator(device=device).manual_seed(step)
    ids = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g, device=device)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def single_process_env():
    """The environment of a one-rank job (what torchrun would set), where not set already."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")


def init_single_process():
    """A one-rank NCCL process group on GPU 0 (FSDP2, DeepSpeed and plait want one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    single_process_env()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")


def ds_like_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": list(BETAS)},
        },
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 50_000_000,
            "allgather_bucket_size": 50_000_000,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000,
        },
    }


def engine_step(engine, cfg, device, micro: int = MICRO):
    """A step function for any engine with DeepSpeed's API (plait's or DeepSpeed's), ``micro`` sequences
    per step; ``probe`` (if given) runs between backward and the optimizer step."""

    def step(i, probe=None):
        loss = engine(**batch(cfg, device, i, micro=micro))
        engine.backward(loss)
        if probe is not None:
            probe()
        engine.step()
        return loss

    return step


def _error_line(text: str) -> str:
    """The child's last exception line (``Name: message``, torchrun's ``[rankN]:`` prefix dropped), else its
    last lines; a warning that merely starts with "Error" (torchtitan's "Error running lspci") is not one."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", x) for x in text.strip().splitlines() if x.strip()]
    exc = [x for x in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)(:|$)", x)]
    return exc[-1] if exc else " | ".join(lines[-3:]) or "no output"


def run_child(
    script: str,
    arm: str,
    args: list[str],
    timeout: float,
    log_path: str | None = None,
    launcher: list[str] = (),
) -> dict:
    """Run ``python *launcher script --one arm *args`` in its own process group (``launcher``: e.g.
    ``-m torch.distributed.run --nproc-per-node 2``); its ``RESULT {json}`` line, or a row ``{"arm",
    "error"}`` when it fails, prints no result, or runs past ``timeout`` seconds (then the whole group is
    killed: compile workers and torchrun's ranks too)."""
    cmd = [sys.executable, *launcher, script, "--one", arm, *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    if log_path:
        with open(log_path, "w") as f:
            f.write(out)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if line is not None:
        return json.loads(line[7:])
    if timed_out:
        return {
            "arm": arm,
            "error": f"timeout after {timeout:.0f} s (last: {_error_line(out)[:200]})",
        }
    return {"arm": arm, "error": f"exit {proc.returncode}: {_error_line(out)}"}


def run_arms(
    script: str,
    arms: list[str],
    args,
    child_args: list[str],
    launcher: list[str] = (),
    tags: dict | None = None,
) -> list[dict]:
    """Run each arm with ``run_child`` (``args``: ``timeout``, ``out``, ``logs``); append each row, with
    ``tags`` filled in where the row lacks them and the wall time, to ``args.out`` as a JSON line and print
    it (without its ``parts``). Returns the rows."""
    for folder in (args.logs, os.path.dirname(args.out)):
        if folder:
            os.makedirs(folder, exist_ok=True)
    rows = []
    with open(args.out, "a") as f:
        for arm in arms:
            t0 = time.perf_counter()
            log = os.path.join(args.logs, f"{arm}.log") if args.logs else f"{args.out}.{arm}.log"
            row = run_child(script, arm, child_args, args.timeout, log_path=log, launcher=launcher)
            row.update({k: v for k, v in (tags or {}).items() if k not in row})
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps({k: v for k, v in row.items() if k != "parts"}), flush=True)
    return rows


def child_or_report(args, run_arm, report) -> bool:
    """The two modes besides a run of arms: ``--one ARM`` (a torchrun child: rank 0 prints its row as a
    ``RESULT`` line) and ``--report JSONL...`` (the tables of earlier runs). True when one of them ran."""
    if args.one:
        row = run_arm(args.one, args)
        if int(os.environ.get("RANK", 0)) == 0:
            print("RESULT " + json.dumps(row), flush=True)
        return True
    if args.report:
        print(
            report(
                [json.loads(line) for path in args.report for line in open(path) if line.strip()]
            )
        )
        return True
    return False


def known_arms(text: str, arms: tuple) -> list[str]:
    """The comma-separated arms of ``text``; SystemExit naming any not in ``arms``."""
    chosen = [a for a in text.split(",") if a]
    unknown = [a for a in chosen if a not in arms]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {','.join(arms)}")
    return chosen


def chosen_arms(args, known: tuple) -> list[str]:
    """``--arms`` checked against ``known`` (and -f8gather against ``--stage``); ``--out`` cleared."""
    arms = known_arms(args.arms, known)
    if args.stage != 3 and any(a.endswith("-f8gather") for a in arms):
        raise SystemExit("the -f8gather arm gathers ZeRO-3's parameters in float8: pass --stage 3")
    if os.path.exists(args.out):
        os.remove(args.out)
    return arms


def fsdp2_wrap(model) -> None:
    """FSDP2 as the benchmarks run it: ``fully_shard`` on each of ``model.blocks`` and on the root,
    bf16 parameters, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def torch_step(model, opt, cfg, device, micro: int = MICRO, autocast: bool = False):
    """A plain torch training step (forward, backward, ``probe``, clip 1.0, optimizer step, grads to None);
    ``autocast``: bf16 autocast around the forward (fp32 parameters; FSDP2 casts its own)."""

    def step(i, probe=None):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch(cfg, device, i, micro=micro))
        loss.backward()
        if probe is not None:
            probe()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def profile_steps(step, first: int, name: str, top: int = 25, steps: int = 2) -> None:
    """Profile ``steps`` calls ``step(first + i)`` (after the caller's warm-up) and print the wall time and GPU
    busy time (sum of kernel times) per step, the top kernels by total CUDA time and the top host ops by self
    CPU time, grouped by name. The gap between wall and busy time is host overhead and idle GPU."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(first + i)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in events) / steps / 1e3
    print(f"\n== {name}: step wall {wall * 1e3:.1f} ms, GPU kernels {busy:.1f} ms per step")
    print("| ms/step | calls/step | kernel |\n|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(
            f"| {e.self_device_time_total / steps / 1e3:.2f} | {e.count // steps} | {e.key[:110]} |",
            flush=True,
        )
    host = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    print("\n| host ms/step (self) | calls/step | op |\n|---|---|---|")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(
            f"| {e.self_cpu_time_total / steps / 1e3:.2f} | {e.count // steps} | {e.key[:110]} |",
            flush=True,
        )


def gc_pauses():
    """Record the cyclic garbage collector's pauses of 1 ms or more (generation, ms) while registered."""

    class Pauses:
        def __init__(self):
            self.ms, self.start = [], 0.0

        def note(self, phase, info):
            if phase == "start":
                self.start = time.perf_counter()
            elif (ms := (time.perf_counter() - self.start) * 1e3) >= 1.0:
                self.ms.append((info["generation"], round(ms, 2)))

    pauses = Pauses()
    gc.callbacks.append(pauses.note)
    return pauses


def timed_steps(step, first: int, count: int, gc_mode: str = "auto") -> dict:
    """The timed steps of an arm, on every rank: ``step(first)`` .. ``step(first + count - 1)``. With
    ``gc_mode`` "freeze" the cyclic collector collects and freezes (``gc.freeze``) first, so a full collection
    of the start-up's objects cannot land inside the few timed steps of one arm and not another's; then a
    barrier, so no rank's collection is timed in another's first step. Returns ``loss`` (the last step's
    result), ``step_s`` (wall seconds per step, to the device's end), ``step_ms`` (each step's device time in
    ms, CUDA events in stream order, no sync inside the loop) and ``gc_pauses_ms`` (``gc_pauses``)."""
    import torch.distributed as dist

    if gc_mode == "freeze":
        gc.collect()
        gc.freeze()
    dist.barrier()
    pauses = gc_pauses()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
    try:
        t0 = time.perf_counter()
        marks[0].record()
        for k in range(count):
            loss = step(first + k)
            marks[k + 1].record()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / count
    finally:
        gc.callbacks.remove(pauses.note)
    return {
        "loss": loss,
        "step_s": dt,
        "step_ms": [round(a.elapsed_time(b), 2) for a, b in zip(marks, marks[1:])],
        "gc_pauses_ms": pauses.ms,
    }
