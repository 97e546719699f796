"""Shared pieces of the example training scripts (pretrain_gpt.py, pretrain_bert.py, compose_model.py):
the data, an endless resumable loader, progress lines and JSONL metrics, and checkpoint resume (the
parallel layout and the ds_config: ``pretrain_layout``).

Nothing here keeps module-level state; every helper takes what it needs as arguments.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist


PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12}


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
    key = hashlib.sha256(
        json.dumps(
            [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in data]
            + [str(tok_path)]
        ).encode()
    ).hexdigest()[:12]
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
        raise ValueError(
            f"the validation split has {num_samples} samples, fewer than the {dp} data-parallel "
            "ranks; raise --val-fraction or shorten --seq-len"
        )
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

    def __init__(
        self,
        path: Path,
        enabled: bool,
        world: int,
        device: torch.device,
        flops_token: float,
        peak: float | None,
        unit: str = "tokens",
    ):
        self.enabled, self.world, self.device, self.flops_token, self.peak = (
            enabled,
            world,
            device,
            flops_token,
            peak,
        )
        self.unit = unit
        self.file = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.t_last, self.items_last = time.perf_counter(), 0
        self.t_begin, self.step_begin = self.t_last, 0

    def begin(self, step: int) -> None:
        """Start the run clock at ``step`` (0, or the step a resumed run starts from): the elapsed time and
        ETA of each progress line count from here."""
        self.t_begin, self.step_begin = time.perf_counter(), step

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
        elapsed = now - self.t_begin
        eta = elapsed / max(step - self.step_begin, 1) * max(total - step, 0)
        rec = {
            "type": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            f"{self.unit}_per_s": rate,
            "grad_norm": engine.grad_norm,
            "loss_scale": engine.loss_scale,
            "peak_mem_gib": mem,
            "skipped_steps": engine.skipped_steps,
            "elapsed_s": elapsed,
            "eta_s": eta,
            "time": time.time(),
        }
        line = (
            f"step {step:>6}/{total} | loss {loss:7.4f} | lr {lr:.2e} | {rate:>10,.0f} {self.unit}/s | "
            f"mem {mem:.2f} {mem_unit} | grad norm {engine.grad_norm or 0.0:.3f} | "
            f"loss scale {engine.loss_scale:g} | skipped {engine.skipped_steps} | "
            f"{fmt_time(elapsed)} elapsed, ETA {fmt_time(eta)}"
        )
        if self.peak and self.unit == "tokens":
            rec["mfu"] = rate * self.flops_token / (self.world * self.peak)
            line += f" | MFU {100 * rec['mfu']:.1f}%"
        moe = engine.moe_stats()  # collective: every rank's Progress calls it
        if moe is not None:
            rec.update(moe)
            line += f" | moe aux {moe['aux_loss']:.4f} | imbalance {moe['load_imbalance']:.2f}"
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
            raise SystemExit(
                f"--resume: no checkpoint in {ckpt_dir} ({ckpt_dir / 'latest'} is missing); "
                f"train without --resume first, or point --out-dir at the run"
            )
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
    if (
        args.crash_at_step == step
        and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        and dist.get_rank() == 1
    ):
        print(f"[rank 1] killing myself with SIGKILL at step {step} (test hook)", flush=True)
        os.kill(os.getpid(), 9)


def fmt_time(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def finite(x: float) -> bool:
    return x is not None and math.isfinite(x)
