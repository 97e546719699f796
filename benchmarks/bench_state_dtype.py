"""Convergence with Adam's moments stored in fp32, bf16 and int8 (``optimizer.params.state_dtype``): the same
``examples/pretrain_gpt.py`` run per precision on the bundled corpus, the validation loss at fixed steps side
by side (issue 43's convergence table); the arms ``fp8-tensorwise`` / ``fp8-rowwise`` keep fp32 moments and turn on
the ds_config's ``fp8`` section instead (float8 matmuls through torchao: issue 46's convergence against the fp32
arm, whose matmuls run in bf16).

    python benchmarks/bench_state_dtype.py [--arms fp32,bf16,int8] [--steps 500] [--eval-every 50]
        [--out rows.jsonl] [--log runs.log] [--table table.md]
    python benchmarks/bench_state_dtype.py --dry-run     # llama-tiny on the CPU, 12 steps: checks the script

Each arm is one ``torchrun --nproc-per-node 1 examples/pretrain_gpt.py`` process with the script's default
config (``examples/configs/pretrain_gpt.json``: AdamW betas 0.9/0.95, weight decay 0.1, clip 1.0, warm-up
10% then cosine to 0.1x) plus ``optimizer.params.state_dtype`` = the arm, ZeRO-2 on one GPU (the moments
stay on the GPU: ``plait.zero.offload.device_states``), fp32 masters. Defaults: llama-886m (789M parameters
with the bundled 8192-entry vocabulary), sequence 2048, micro-batch 4, global batch 4 (8192 tokens a step;
500 steps = 4.1M tokens, about 3.5 passes over the corpus's 1.16M training tokens), peak lr 3e-4, seed 1234,
validation every ``--eval-every`` steps over ``--eval-batches`` batches of the held-out 2%. The same seed and
data order in every arm: the arms differ in the moments' storage only.

Reported: one row per arm (``--out``: the validation losses by step, the last logged training loss, tokens/s
of the run, peak GPU memory, the final validation loss's difference from the fp32 arm in percent), every
arm's full output (``--log``), and the markdown table (printed; ``--table`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("fp32", "bf16", "int8", "fp8-tensorwise", "fp8-rowwise")


def arm_config(arm: str, folder: str) -> str:
    """``examples/configs/pretrain_gpt.json`` with ``optimizer.params.state_dtype`` = ``arm`` (or, for an
    ``fp8-RECIPE`` arm, the ``fp8`` section enabled with that recipe), written to ``folder``."""
    with open(os.path.join(ROOT, "examples", "configs", "pretrain_gpt.json")) as f:
        config = json.load(f)
    if arm.startswith("fp8-"):
        config["fp8"] = {"enabled": True, "recipe": arm.removeprefix("fp8-")}
    else:
        config["optimizer"]["params"]["state_dtype"] = arm
    path = os.path.join(folder, f"pretrain_gpt_{arm}.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return path


def pretrain_command(opt: argparse.Namespace, config: str, out_dir: str) -> list[str]:
    """The torchrun command line of one arm."""
    model = (
        ["--model", "llama-tiny", "--precision", "fp32"] if opt.dry_run else ["--model", opt.model]
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        os.path.join(ROOT, "examples", "pretrain_gpt.py"),
        *model,
        "--config",
        config,
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero-stage",
        str(opt.zero_stage),
        "--seq-len",
        str(opt.seq),
        "--micro-batch",
        str(opt.micro),
        "--global-batch",
        str(opt.global_batch),
        "--steps",
        str(opt.steps),
        "--lr",
        str(opt.lr),
        "--log-every",
        str(opt.log_every),
        "--eval-every",
        str(opt.eval_every),
        "--eval-batches",
        str(opt.eval_batches),
        "--save-every",
        str(opt.steps),
        "--keep-last",
        "1",
        "--no-export",
        "--resume",
        "never",
        "--out-dir",
        out_dir,
    ]


def run_arm(opt: argparse.Namespace, state_dtype: str, folder: str) -> dict:
    """One arm: run it, then read its ``metrics.jsonl`` into a row (or ``{"arm", "error"}``)."""
    out_dir = os.path.join(folder, state_dtype)
    cmd = pretrain_command(opt, arm_config(state_dtype, folder), out_dir)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=opt.arm_timeout)
    if opt.log:
        with open(opt.log, "a") as f:
            f.write(f"=== {state_dtype}: {' '.join(cmd[1:])}\n{done.stdout}{done.stderr}\n")
    metrics = os.path.join(out_dir, "metrics.jsonl")
    records = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            records = [json.loads(x) for x in f]
    val = {r["step"]: r["val_loss"] for r in records if r.get("type") == "val"}
    train = [r for r in records if r.get("type") == "train"]
    summary = next((r for r in records if r.get("type") == "summary"), None)
    if done.returncode != 0 or summary is None:
        causes = [
            x for x in done.stderr.splitlines() if "Error" in x and "ChildFailedError" not in x
        ]
        return {
            "arm": state_dtype,
            "error": "\n".join(causes[-3:]) or done.stderr[-1500:],
            "returncode": done.returncode,
            "val_loss": val,
        }
    return {
        "arm": state_dtype,
        "state_dtype": "fp32" if state_dtype.startswith("fp8-") else state_dtype,
        "model": "llama-tiny" if opt.dry_run else opt.model,
        "steps": summary["step"],
        "seq": opt.seq,
        "global_batch": opt.global_batch,
        "lr": opt.lr,
        "val_loss": val,
        "train_loss": {r["step"]: r["loss"] for r in train},
        "train_loss_last": train[-1]["loss"] if train else None,
        "tokens_per_s": summary.get("tokens_per_s"),
        "peak_gib": summary["peak_mem_gib"],
        "train_s": summary["train_seconds"],
    }


def table(rows: list[dict]) -> str:
    """Validation loss by step, one column per arm; then the final losses, the difference from fp32, speed."""
    good = [r for r in rows if "error" not in r]
    steps = sorted({s for r in good for s in map(int, r["val_loss"])})
    head = "| step | " + " | ".join(f"val loss {r['arm']}" for r in good) + " |"
    lines = [head, "|---|" + "---|" * len(good)]
    lines += [
        f"| {s} | "
        + " | ".join(
            f"{r['val_loss'].get(s, r['val_loss'].get(str(s), float('nan'))):.4f}" for r in good
        )
        + " |"
        for s in steps
    ]
    base = next((r for r in good if r["arm"] == "fp32"), None)
    lines += [
        "",
        "| arm | final val loss | vs fp32 | last train loss | tokens/s | peak GPU GiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | failed: {r['error'][-160:]!r} | | | | |")
            continue
        final = r["val_loss"][max(r["val_loss"], key=int)]
        ref = base["val_loss"][max(base["val_loss"], key=int)] if base else None
        diff = f"{100 * (final - ref) / ref:+.2f}%" if ref else "-"
        lines.append(
            f"| {r['arm']} | {final:.4f} | {diff} | {r['train_loss_last']:.4f} | "
            f"{r['tokens_per_s'] or 0:,.0f} | {r['peak_gib']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument(
        "--arms",
        default=",".join(ARMS),
        help="state dtypes or fp8-RECIPE, in order (fp32 first: the reference)",
    )
    cli.add_argument("--model", default="llama-886m")
    cli.add_argument("--steps", type=int, default=500)
    cli.add_argument("--seq", type=int, default=2048)
    cli.add_argument("--micro", type=int, default=4)
    cli.add_argument("--global-batch", type=int, default=4)
    cli.add_argument("--lr", type=float, default=3e-4)
    cli.add_argument("--zero-stage", type=int, default=2)
    cli.add_argument("--log-every", type=int, default=10)
    cli.add_argument("--eval-every", type=int, default=50)
    cli.add_argument("--eval-batches", type=int, default=4)
    cli.add_argument(
        "--arm-timeout", type=float, default=None, help="seconds before an arm is stopped"
    )
    cli.add_argument("--out", default=None, help="append each arm's row (JSON) to this file")
    cli.add_argument("--log", default=None, help="append each arm's full output to this file")
    cli.add_argument("--table", default=None, help="also write the markdown table to this file")
    cli.add_argument(
        "--dry-run",
        action="store_true",
        help="llama-tiny in fp32 on the CPU, 12 steps of 128 tokens, validation every 4: checks the script",
    )
    opt = cli.parse_args()
    if opt.dry_run:
        opt.steps, opt.seq, opt.micro, opt.global_batch, opt.eval_every, opt.log_every = (
            12,
            128,
            2,
            2,
            4,
            4,
        )
        opt.eval_batches = 2
    for arm in opt.arms.split(","):
        if arm not in ARMS:
            cli.error(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    folder = tempfile.mkdtemp(prefix="bench_state_dtype_")
    rows = []
    for arm in opt.arms.split(","):
        try:
            row = run_arm(opt, arm, folder)
        except subprocess.TimeoutExpired:
            row = {"arm": arm, "error": f"stopped after --arm-timeout {opt.arm_timeout} s"}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if opt.out:
            with open(opt.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    text = table(rows)
    print("\n" + text)
    if opt.table:
        with open(opt.table, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
