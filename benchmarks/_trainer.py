"""What the Hugging Face Trainer benchmarks share (bench_hf_trainer.py, bench_trl.py): the model's shape and
sequence (a tiny one on the CPU with ``BENCH_SMOKE=1``), the ``TrainingArguments`` every arm shares, the step
clock and the timed ``train()`` that make an arm's row, and the parent's side: each arm launched in its own
process and the markdown table of the rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

SMOKE = (
    os.environ.get("BENCH_SMOKE") == "1"
)  # a tiny model on the CPU: checks the script, measures nothing
SEQ, MICRO = (64, 2) if SMOKE else (2048, 4)
SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=SEQ,
)
if SMOKE:
    SHAPE.update(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainer_arguments(arm: str, micro: int, max_steps: int) -> dict:
    """The ``TrainingArguments`` every arm shares: AdamW lr 1e-4 (constant after 1 warm-up step: DeepSpeed's
    WarmupLR refuses 0), weight decay 0.1, clip 1.0, GAS 1, a loss logged every step, no saving, bf16 (fp32 on
    the CPU in smoke mode), ``BENCH_WORKERS`` data-loader workers (default 2)."""
    return dict(
        output_dir=tempfile.mkdtemp(prefix=f"bench_{arm}_"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=1,
        learning_rate=1e-4,
        weight_decay=0.1,
        max_grad_norm=1.0,
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        lr_scheduler_type="constant",
        warmup_steps=1,
        dataloader_num_workers=int(os.environ.get("BENCH_WORKERS", "2")),
        use_cpu=SMOKE,
        bf16=not SMOKE,
    )


def step_clock(warmup: int, steps: int):
    """A ``TrainerCallback`` that records in its ``marks`` the wall time at the ends of steps ``warmup`` and
    ``warmup + steps`` (each after a CUDA synchronization) and resets the peak-memory counter after the warm-up."""
    import torch
    import transformers

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.marks, self.warmup, self.steps = {}, warmup, steps

        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (warmup, warmup + steps):
                if not SMOKE:
                    torch.cuda.synchronize()
                self.marks[state.global_step] = time.perf_counter()
            if state.global_step == warmup and not SMOKE:
                torch.cuda.reset_peak_memory_stats()

    return Clock()


def timed_train(arm: str, trainer, clock, tokens_per_step: int, n_params: int) -> dict:
    """``trainer.train()`` timed by ``clock`` (``step_clock``): the row's common fields (tokens/s over the timed
    steps in total over the ``world`` data-parallel ranks, ``tokens_per_step`` being one rank's, and per GPU;
    seconds a step; peak GPU memory of this rank, which prints the row: rank 0; peak host memory summed over
    the ranks; the last logged loss, versions, host threads)."""
    import torch
    import transformers

    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    dt = clock.marks[clock.warmup + clock.steps] - clock.marks[clock.warmup]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    world, host_peaks = _over_ranks(_host_peak_gib())
    return {
        "arm": arm,
        "params": n_params,
        "world": world,
        "tokens_per_s": tokens_per_step * world * clock.steps / dt,
        "tokens_per_s_gpu": tokens_per_step * clock.steps / dt,
        "step_s": dt / clock.steps,
        "peak_gib": 0.0 if SMOKE else torch.cuda.max_memory_allocated() / 2**30,
        "host_peak_gib": sum(host_peaks),
        "host_peak_gib_ranks": host_peaks,
        "loss": losses[-1] if losses else None,
        "train_s": total,
        "device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "host": _host_threads(),
    }


def _over_ranks(value: float) -> tuple[int, list[float]]:
    """The world size and every rank's ``value`` (all ranks call this; one process without a process
    group: ``(1, [value])``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return len(values), values


def _host_peak_gib() -> float:
    """This process's peak resident host memory (VmHWM), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def _host_threads() -> dict:
    """What decides the CPU optimizers' speed: cores this process may use, numba's pool and layer, torch's."""
    import torch

    info = {
        "affinity": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "omp_env": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import numba

        info.update(
            numba_threads=numba.config.NUMBA_NUM_THREADS, numba_layer=numba.threading_layer()
        )
    except (ImportError, ValueError):  # ValueError: no parallel kernel ran yet
        pass
    return info


def launch_arm(
    script: str,
    arm: str,
    args: list[str],
    nproc: int,
    log: str | None = None,
    out: str | None = None,
) -> dict:
    """Run ``script --arm ARM ARGS`` under torchrun with ``nproc`` processes (one node) and return the row of
    its ``RESULT {json}`` line (rank 0's), or ``{"arm", "error", "returncode"}`` holding the child's own error lines (not
    torchrun's); the row is printed as JSON and appended to the file ``out``. ``log``: a file the child's stdout
    and stderr are appended to."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        script,
        "--arm",
        arm,
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if log:
        with open(log, "a") as f:
            f.write(f"=== {arm}: {' '.join(cmd[1:])}\n{done.stdout}{done.stderr}\n")
    found = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    causes = [
        x for x in (done.stderr or "").splitlines() if "Error" in x and "ChildFailedError" not in x
    ]
    why = "\n".join(causes[-3:]) or (done.stderr or done.stdout)[-1500:]
    row = (
        json.loads(found[-1][7:])
        if found
        else {"arm": arm, "world": nproc, "error": why, "returncode": done.returncode}
    )
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def print_table(rows: list[dict]) -> None:
    """The markdown table of the rows (a failed arm: the end of its error): tokens/s in total and per GPU,
    peak GPU memory of rank 0, host peak summed over the node's ranks."""
    print(
        "\n| arm | GPUs | parameters | tokens/s | tokens/s/GPU | step s | peak GPU GiB (rank 0) "
        "| host peak GiB (all ranks) | last loss |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        if "error" in r:
            print(
                f"| {r['arm']} | {r.get('world', '')} | | failed: {r['error'][-160:]!r} | | | | | |"
            )
        else:
            print(
                f"| {r['arm']} | {r['world']} | {r['params'] / 1e9:.2f}B | {r['tokens_per_s']:.0f} | "
                f"{r['tokens_per_s_gpu']:.0f} | {r['step_s']:.3f} | {r['peak_gib']:.2f} | "
                f"{r['host_peak_gib']:.1f} | {r['loss']:.4f} |"
            )
