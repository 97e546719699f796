"""Shared pieces of the example training scripts (pretrain_gpt.py, pretrain_bert.py, compose_model.py):
command line for the parallel layout and the ds_config overrides, the data, an endless resumable
loader, progress lines and JSONL metrics, and checkpoint resume.

Nothing here keeps module-level state; every helper takes what it needs as arguments.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from plait.config import load_config
from plait.parallel import ParallelMesh, init_distributed

EXAMPLES = Path(__file__).resolve().parent
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12}


# ---- command line -----------------------------------------------------------------------------------
def add_parallel_args(parser: argparse.ArgumentParser, default_config: str) -> None:
    """Layout, ds_config and loop flags shared by the example scripts."""
    g = parser.add_argument_group("layout and ds_config (command-line values override the JSON)")
    g.add_argument("--config", "--deepspeed_config", "--deepspeed-config", dest="config",
                   default=str(EXAMPLES / "configs" / default_config),
                   help="DeepSpeed-style JSON (default: %(default)s)")
    g.add_argument("--tp", type=int, help="tensor-parallel size (default: config, else 2 when the world "
                                          "size is even)")
    g.add_argument("--pp", type=int, help="pipeline-parallel size (default: config, else 2 when the world "
                                          "size is a multiple of 4)")
    g.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb-h1"], help="pipeline schedule")
    g.add_argument("--virtual-stages", type=int, help="model chunks per pipeline rank (interleaved)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    g.add_argument("--offload", choices=["none", "optimizer", "param", "all"],
                   help="ZeRO-Offload of optimizer states and/or parameters to the CPU")
    g.add_argument("--micro-batch", type=int, help="samples per rank per micro-step")
    g.add_argument("--global-batch", type=int, help="samples per optimizer step over all dp ranks")
    g.add_argument("--grad-accum", type=int, help="gradient accumulation steps (pipeline micro-batches)")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: bf16 on GPUs that have it, fp32 on CPU")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup", type=int, help="warmup steps (default: 10%% of --steps)")
    g.add_argument("--clip", type=float, help="gradient clipping (max global norm)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--recompute", action="store_true", help="recompute each block's activations in backward")
    g.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile each transformer block (auto: the config's compile section, else on for "
                        "CUDA and off on CPU)")

    r = parser.add_argument_group("run")
    r.add_argument("--steps", type=int, default=300, help="optimizer steps in the whole run")
    r.add_argument("--log-every", type=int, default=10)
    r.add_argument("--eval-every", type=int, default=50)
    r.add_argument("--eval-batches", type=int, default=4, help="eval_batch calls per validation")
    r.add_argument("--save-every", type=int, default=100)
    r.add_argument("--keep-last", type=int, default=2, help="checkpoints kept on disk")
    r.add_argument("--out-dir", default="runs/" + Path(sys.argv[0]).stem,
                   help="checkpoints/, metrics.jsonl and the exports go here (default: %(default)s)")
    r.add_argument("--resume", nargs="?", const="latest", default="auto",
                   help="auto (default): continue from <out-dir>/checkpoints/latest when it exists "
                        "(what torchrun --max-restarts needs); --resume alone: require it; never: start over; "
                        "or a checkpoint tag")
    r.add_argument("--stop-at-step", type=int, help="stop (after saving) at this step, as if interrupted")
    r.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    r.add_argument("--peak-tflops", type=float, help="per-device peak for MFU (default: H100/H200 bf16)")
    r.add_argument("--crash-at-step", type=int, help=argparse.SUPPRESS)   # tests: SIGKILL global rank 1


def choose_layout(args, raw: dict, world: int) -> tuple[int, int]:
    """(tp, pp): command line, else the config's sections, else 2 x 2 / 2 x 1 / 1 x 1 by world size."""
    tp = args.tp or raw.get("tensor_parallel", {}).get("size")
    pp = args.pp or raw.get("pipeline", {}).get("size") or raw.get("pipeline", {}).get("stages")
    if tp is None and pp is None:
        tp, pp = (2, 2) if world % 4 == 0 else (2, 1) if world % 2 == 0 else (1, 1)
    elif tp is None:
        tp = 2 if world % (2 * pp) == 0 else 1
    elif pp is None:
        pp = 2 if world % (2 * tp) == 0 else 1
    if world % (tp * pp):
        raise SystemExit(f"world size {world} is not divisible by tp x pp = {tp} x {pp}; launch a multiple of "
                         f"{tp * pp} processes (torchrun --nproc-per-node) or change --tp/--pp")
    return tp, pp


def apply_zero_flags(cfg: dict, args) -> None:
    """``--zero-stage`` and ``--offload {none,optimizer,param,all}`` into a ds_config dict, in place."""
    zero = cfg.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    if args.offload is not None:
        zero["offload_optimizer"] = {"device": "cpu" if args.offload in ("optimizer", "all") else "none"}
        zero["offload_param"] = {"device": "cpu" if args.offload in ("param", "all") else "none"}


def build_ds_config(args, raw: dict, tp: int, pp: int) -> dict:
    """The ds_config dict after command-line overrides (the JSON file itself is not changed)."""
    cfg = json.loads(json.dumps(raw))
    cfg.setdefault("tensor_parallel", {})["size"] = tp
    pipe = cfg.setdefault("pipeline", {})
    pipe.pop("stages", None)
    pipe["size"] = pp
    if args.sequence_parallel is not None:
        cfg["tensor_parallel"]["sequence_parallel"] = args.sequence_parallel and tp > 1
    if args.schedule:
        pipe["schedule"] = args.schedule
    if args.virtual_stages:
        pipe["virtual_stages"] = args.virtual_stages
    if pipe.get("schedule") == "interleaved" and pipe.get("virtual_stages", 1) < 2:
        pipe["virtual_stages"] = 2
    triple = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    given = {"train_batch_size": args.global_batch, "train_micro_batch_size_per_gpu": args.micro_batch,
             "gradient_accumulation_steps": args.grad_accum}
    for key, value in given.items():
        if value is not None:
            cfg[key] = value
    if all(k in cfg for k in triple) and given["gradient_accumulation_steps"] is None:
        cfg.pop("gradient_accumulation_steps")       # keep the global batch, derive accumulation
    elif all(k in cfg for k in triple) and given["train_batch_size"] is None:
        cfg.pop("train_batch_size")
    apply_zero_flags(cfg, args)
    if args.clip is not None:
        cfg["gradient_clipping"] = args.clip
    if args.lr is not None:
        cfg.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
        sched = cfg.get("scheduler", {}).get("params", {})
        if "warmup_max_lr" in sched:
            sched["warmup_max_lr"] = args.lr
    cfg.setdefault("seed", args.seed)
    return cfg


def precision_for(args, device: torch.device) -> str:
    if args.precision != "auto":
        return args.precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def setup(args, model_hidden: int):
    """Start the process group and build the mesh and resolved config.

    Returns ``(info, mesh, plait_config, ds_dict)``; ``ds_dict`` is what the config file plus flags said."""
    info = init_distributed(timeout_s=args.timeout)
    with open(args.config, encoding="utf-8") as f:
        raw = json.load(f)
    tp, pp = choose_layout(args, raw, info.world_size)
    mesh = ParallelMesh(tp=tp, pp=pp)
    ds = build_ds_config(args, raw, tp, pp)
    if args.compile != "auto" or "compile" not in ds:
        ds["compile"] = {"enabled": args.compile == "on" or args.compile == "auto" and mesh.device.type == "cuda"}
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    cfg = load_config(ds, dp_size=mesh.dp, model_hidden_size=model_hidden, lr=args.lr,
                      mixed_precision=precision_for(args, mesh.device), warmup_num_steps=warmup,
                      total_num_steps=args.steps)
    return info, mesh, cfg, ds


def zero_desc(cfg) -> str:
    """"ZeRO-3 + offload optimizer, param" style summary of the config's ZeRO section."""
    z = cfg.zero_optimization
    off = [name for name, o in (("optimizer", z.offload_optimizer), ("param", z.offload_param)) if o.enabled]
    return f"ZeRO-{z.stage}" + (f" + offload {', '.join(off)}" if off else "")


def rank0_first(fn, is_rank0: bool):
    """Run ``fn`` on rank 0, then on every other rank after a barrier (builds caches once)."""
    if is_rank0:
        out = fn()
    if dist.is_initialized():
        dist.barrier()
    return out if is_rank0 else fn()


def token_file(args, out_dir: Path, is_rank0: bool) -> tuple[Path, int]:
    """The token file to train on and the tokenizer's vocabulary size.

    Bundled corpus by default; ``--data`` text files are tokenized once into ``<out-dir>/data``;
    one ``.npy`` or ``.bin`` (pre-tokenized) is used as it is."""
    from tokenizers import Tokenizer

    from plait.data import (
        build_token_file,
        bundled_token_file,
        bundled_tokenizer_path,
        read_token_meta,
    )
    tok_path = Path(args.tokenizer) if args.tokenizer else bundled_tokenizer_path()
    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size(with_added_tokens=True)
    if not args.data:
        return rank0_first(bundled_token_file, is_rank0), vocab
    data = [Path(p) for p in args.data]
    missing = [str(p) for p in data if not p.is_file()]
    if missing:
        raise SystemExit(f"--data: no such file(s): {missing}")
    if len(data) == 1 and data[0].suffix in (".npy", ".bin"):
        meta = read_token_meta(data[0]) if data[0].suffix == ".bin" else None
        return data[0], int(meta["vocab_size"]) if meta and meta.get("vocab_size") else vocab
    key = hashlib.sha256(json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in data]
                                    + [str(tok_path)]).encode()).hexdigest()[:12]
    out = out_dir / "data" / f"tokens-{key}.bin"

    def build():
        if not out.is_file() or read_token_meta(out) is None:
            out.parent.mkdir(parents=True, exist_ok=True)
            build_token_file(data, tok_path, out)
        return out

    return rank0_first(build, is_rank0), vocab


# ---- data ----------------------------------------------------------------------------------------------
class EpochLoop:
    """Endless iterator over the epochs of a ``DistributedBatches``; ``transform(batch)`` (optional)
    turns each micro-batch into model inputs. ``state_dict``/``load_state_dict`` pass through, so
    setting ``engine.data_loader = loop`` stores the data position in every checkpoint."""

    def __init__(self, batches, transform=None):
        self.batches, self.transform, self._it = batches, transform, None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.batches)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                continue
            return self.transform(batch) if self.transform else batch
        raise RuntimeError(f"an epoch of {self.batches.num_samples} samples gave no batch")

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)
        self._it = None


def validation_micro_batch(num_samples: int, micro: int, dp: int) -> int:
    """The largest micro-batch <= ``micro`` that gives each of the ``dp`` ranks a full validation batch
    (validation loaders drop the ragged end, so no rank ever sees an empty micro-batch).

    Raises:
        ValueError: the validation split holds fewer samples than there are dp ranks.
    """
    if num_samples < dp:
        raise ValueError(f"the validation split has {num_samples} samples, fewer than the {dp} data-parallel "
                         "ranks; raise --val-fraction or shorten --seq-len")
    return min(micro, num_samples // dp)


@torch.no_grad()
def validate(engine, make_loader, batches: int) -> float:
    """Mean of ``batches`` ``eval_batch`` calls over a fresh, unshuffled validation loader."""
    engine.eval()
    loader = make_loader()
    loss = sum(float(engine.eval_batch(loader)) for _ in range(batches)) / batches
    engine.train()
    return loss


# ---- progress and metrics -------------------------------------------------------------------------------
def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    """Peak allocated device memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "GiB"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "GiB RSS"


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def flops_per_token(num_params: int, num_layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token: 6N + 6 x layers x hidden x seq (ANCHORS.md's MFU rule)."""
    return 6.0 * num_params + 6.0 * num_layers * hidden * seq


class Progress:
    """Progress lines on rank 0 and JSONL records (appended, so a resumed run continues the file)."""

    def __init__(self, path: Path, enabled: bool, world: int, device: torch.device, flops_token: float,
                 peak: float | None, unit: str = "tokens"):
        self.enabled, self.world, self.device, self.flops_token, self.peak = enabled, world, device, flops_token, peak
        self.unit = unit
        self.file = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.t_last, self.items_last = time.perf_counter(), 0

    def say(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def record(self, rec: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def add(self, items: int) -> None:
        """Count tokens (or samples) processed since the last line."""
        self.items_last += items

    def train(self, step: int, total: int, loss: float, engine) -> dict:
        """Log a progress line at ``step`` with ``loss`` (mean over the steps since the last line)."""
        now = time.perf_counter()
        rate = self.items_last / max(now - self.t_last, 1e-9)
        self.t_last, self.items_last = now, 0
        mem, mem_unit = peak_memory_gib(self.device)
        lr = engine.get_lr()[0]
        rec = {"type": "train", "step": step, "loss": loss, "lr": lr, f"{self.unit}_per_s": rate,
               "grad_norm": engine.grad_norm, "loss_scale": engine.loss_scale, "peak_mem_gib": mem,
               "skipped_steps": engine.skipped_steps, "time": time.time()}
        line = (f"step {step:>6}/{total} | loss {loss:7.4f} | lr {lr:.2e} | {rate:>10,.0f} {self.unit}/s | "
                f"mem {mem:.2f} {mem_unit} | grad norm {engine.grad_norm or 0.0:.3f} | "
                f"loss scale {engine.loss_scale:g} | skipped {engine.skipped_steps}")
        if self.peak and self.unit == "tokens":
            rec["mfu"] = rate * self.flops_token / (self.world * self.peak)
            line += f" | MFU {100 * rec['mfu']:.1f}%"
        self.record(rec)
        self.say(line)
        return rec

    def skip_interval(self) -> None:
        """Restart the rate clock (after validation or a checkpoint, so they do not count)."""
        self.t_last, self.items_last = time.perf_counter(), 0

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# ---- checkpoints -----------------------------------------------------------------------------------------
def resume_tag(args, ckpt_dir: Path) -> str | None:
    """The checkpoint tag to resume from (decided on rank 0, broadcast), or None to start fresh."""
    from plait.checkpoint.dirs import read_latest
    if args.resume == "never":
        return None
    latest = read_latest(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    box = [latest]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    latest = box[0]
    if args.resume == "auto":
        return latest
    if args.resume == "latest":
        if latest is None:
            raise SystemExit(f"--resume: no checkpoint in {ckpt_dir} ({ckpt_dir / 'latest'} is missing); "
                             f"train without --resume first, or point --out-dir at the run")
        return latest
    return args.resume


def save(engine, ckpt_dir: Path, step: int, client: dict, keep_last: int, is_rank0: bool) -> float:
    """Save ``step{step}`` (collective), prune old ones on rank 0; returns the seconds it took."""
    from plait.checkpoint.dirs import prune
    t0 = time.perf_counter()
    engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}", client_state=client)
    if is_rank0 and keep_last:
        prune(str(ckpt_dir), keep_last)
    return time.perf_counter() - t0


def maybe_crash(args, step: int) -> None:
    """Test hook: SIGKILL global rank 1 at ``--crash-at-step`` on the first attempt of a torchrun job."""
    if args.crash_at_step == step and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 \
            and dist.get_rank() == 1:
        print(f"[rank 1] killing myself with SIGKILL at step {step} (test hook)", flush=True)
        os.kill(os.getpid(), 9)


def fmt_time(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def finite(x: float) -> bool:
    return x is not None and math.isfinite(x)
