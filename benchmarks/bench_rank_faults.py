"""Wall time a failed rank costs its peers (issue 41): two CPU ranks (gloo), rank 1 fails, rank 0 times its wait.

    python benchmarks/bench_rank_faults.py [--timeout-s 20] [--startup-timeout-s 10]

Each case starts two processes with torchrun's variables (no torchrun agent: what plait itself does, not what
the agent's kill of the other ranks adds). Both build a tiny Llama through ``plait.initialize`` (ZeRO-2, one
step trained), then rank 1 fails and rank 0 measures from the start of its next step to the error it gets:
``exit`` (``sys.exit(1)``), ``raise`` (an uncaught exception), ``kill`` (SIGKILL: the OOM killer, a lost node),
``freeze`` (SIGSTOP after step 1: bounded by ``comm.timeout_s``) and ``freeze before step 1`` (SIGSTOP before
the first step: bounded by ``comm.startup_timeout_s``), against ``none`` (rank 1 trains step 2 too: how long a
clean step and a clean exit take on the same machine). Prints one table row per case.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import textwrap
import time

RANK_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import plait
    from plait.layers import TransformerModel
    from plait.models import preset
    from plait.parallel import ParallelMesh, init_distributed
    mode, timeout_s, startup_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2}, "comm": {"timeout_s": timeout_s, "startup_timeout_s": startup_s}}
    init_distributed()
    mesh = ParallelMesh()
    model = TransformerModel(preset("llama-tiny", vocab_size=257, num_layers=2, hidden_size=32, num_heads=4,
                                    num_kv_heads=2, ffn_hidden_size=48), mesh, seed=5)
    engine = plait.initialize(model, cfg, mesh=mesh)
    ids = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(mesh.dp_rank))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    rank = mesh.dp_rank
    if rank == 1 and mode == "freeze-before":
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode != "freeze-before":
        engine.train_batch(iter([batch]))
    if rank == 1:
        if mode == "exit":
            sys.exit(1)
        if mode == "raise":
            raise RuntimeError("rank 1 fails")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        engine.train_batch(iter([batch]))
    except Exception as err:
        first = str(err).strip().splitlines()[0][:110] if str(err).strip() else type(err).__name__
        print(f"WAITED {time.monotonic() - start:.2f} {time.time():.3f} {type(err).__name__}: {first}", flush=True)
        raise                                   # as a user's script ends: atexit hooks and plait's exit path run
    if mode != "none":
        print("rank 0 trained step 2: the failed peer went unnoticed", flush=True)
    elif rank == 0:
        print(f"WAITED {time.monotonic() - start:.2f} {time.time():.3f} (no error: the baseline)", flush=True)
""")

CASES = {
    "none": "trains step 2 too (no fault)",
    "exit": "sys.exit(1) after step 1",
    "raise": "uncaught exception after step 1",
    "kill": "SIGKILL after step 1",
    "freeze": "SIGSTOP after step 1",
    "freeze-before": "SIGSTOP before step 1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(mode: str, script: str, timeout_s: float, startup_s: float) -> tuple[str, float]:
    """Start both ranks; return rank 0's WAITED line and the time.time() at which rank 0's process ended."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": root,
    }
    argv = [sys.executable, script, mode, str(timeout_s), str(startup_s)]
    procs = [
        subprocess.Popen(
            argv,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    out0 = procs[0].communicate(timeout=4 * max(timeout_s, startup_s) + 120)[0]
    ended = time.time()
    procs[1].kill()
    procs[1].communicate()
    line = next((ln for ln in out0.splitlines() if ln.startswith("WAITED")), None)
    if line is None:
        raise SystemExit(
            f"{mode}: rank 0 printed no wait (rc {procs[0].returncode}):\n{out0[-3000:]}"
        )
    return line, ended


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--timeout-s", type=float, default=20.0, help="comm.timeout_s (default config: 180)"
    )
    ap.add_argument(
        "--startup-timeout-s",
        type=float,
        default=10.0,
        help="comm.startup_timeout_s (default: 600)",
    )
    args = ap.parse_args()
    script = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"plait_rank_faults_{os.getpid()}.py")
    with open(script, "w") as f:
        f.write(RANK_SCRIPT)
    print(
        f"2 gloo ranks on CPU ({os.cpu_count()} cores), comm.timeout_s={args.timeout_s:g}, "
        f"comm.startup_timeout_s={args.startup_timeout_s:g}"
    )
    print(
        "| rank 1 | rank 0 waited in its step (s) | then rank 0's process ended after (s) | rank 0's error |"
    )
    print("|---|---|---|---|")
    for mode, what in CASES.items():
        line, ended = run_case(mode, script, args.timeout_s, args.startup_timeout_s)
        _, waited, failed_at, error = line.split(" ", 3)
        print(f"| {what} | {waited} | {ended - float(failed_at):.1f} | {error} |", flush=True)
    os.remove(script)


if __name__ == "__main__":
    main()
