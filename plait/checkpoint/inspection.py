"""Inspection of plait checkpoints: ``consolidate`` (every logical tensor whole in one safetensors
file) and ``describe`` / ``inspect`` (a readable listing of tensors, shapes, dtypes, meta and files).
Runs in one process; ``consolidate`` holds the whole checkpoint in memory.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

from plait.checkpoint.hf_import import HF_KEY
from plait.checkpoint.index import OPTIMIZER_PREFIX
from plait.checkpoint.model_io import EXTRA_PREFIX, MESH_KEY, MODEL_CONFIG_KEY
from plait.checkpoint.reader import CheckpointReader
from plait.dtypes import cast_floating, parse_dtype


def consolidate(
    plait_root: str,
    out_file: str,
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
    model_only: bool = False,
) -> str:
    """Write every logical tensor of ``<plait_root>/<tag>`` whole into one safetensors file.

    Names stay plait's logical names (``optimizer.exp_avg.<param>`` etc. too unless ``model_only``,
    which also drops ``hf_extra.`` tensors). ``dtype`` casts floating tensors. The header metadata
    holds ``plait_tag`` and ``plait_meta`` (meta.json as JSON text). Returns ``out_file``.
    """
    dtype = parse_dtype(dtype)
    reader = CheckpointReader(plait_root, tag)
    names = [
        n
        for n in reader.names()
        if not model_only or not n.startswith((OPTIMIZER_PREFIX, EXTRA_PREFIX))
    ]
    tensors = {n: cast_floating(reader.read(n), dtype) for n in names}
    parent = os.path.dirname(os.path.abspath(out_file))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_file}.tmp-{os.getpid()}"
    save_file(
        tensors,
        tmp,
        metadata={
            "format": "pt",
            "plait_tag": reader.tag,
            "plait_meta": json.dumps(reader.meta, sort_keys=True),
        },
    )
    os.replace(tmp, out_file)
    return os.fspath(out_file)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def describe(plait_root: str, tag: str | None = None) -> str:
    """The text ``inspect`` prints: header, meta summary, one line per tensor, files and sizes."""
    r = CheckpointReader(plait_root, tag, verify="size")
    idx, meta = r.index, r.meta
    lines = [
        f"checkpoint {r.path}",
        (
            f"  tag {r.tag}, saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(idx['saved_at']))}, "
            f"{idx['writers']} writer rank(s), fingerprint {idx['model_fingerprint']}"
        ),
    ]
    counters = {**meta, **(meta.get("engine") if isinstance(meta.get("engine"), dict) else {})}
    steps = {
        k: v
        for k, v in counters.items()
        if ("step" in k or "sample" in k or k == "zero_stage") and isinstance(v, (int, float))
    }
    if steps:
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in sorted(steps.items())))
    if isinstance(meta.get(MESH_KEY), dict):
        lines.append(
            "  saved from mesh " + ", ".join(f"{k}={v}" for k, v in meta[MESH_KEY].items())
        )
    cfg = meta.get(MODEL_CONFIG_KEY)
    if isinstance(cfg, dict):
        keys = (
            "arch",
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
        )
        lines.append("  model " + ", ".join(f"{k}={cfg.get(k)}" for k in keys))
    if isinstance(meta.get(HF_KEY), dict):
        h = meta[HF_KEY]
        lines.append(
            f"  from Hugging Face {h.get('architecture')} ({h.get('source')}); "
            f"missing {len(h.get('missing', []))}, kept extra {len(h.get('extra', []))}"
        )
    names = r.names()
    width = max([len(n) for n in names] + [4])
    lines.append(f"\n  {'name':<{width}}  {'shape':<20} {'dtype':<9} slices")
    total, count = 0, 0
    for n in names:
        e = r.index["tensors"][n]
        numel = 1
        for s in e["shape"]:
            numel *= s
        count += numel if not n.startswith((OPTIMIZER_PREFIX, EXTRA_PREFIX)) else 0
        total += numel * torch.empty(0, dtype=r.dtype(n)).element_size()
        lines.append(f"  {n:<{width}}  {e['shape']!s:<20} {e['dtype']:<9} {len(e['slices'])}")
    lines.append(
        f"\n  {len(names)} tensors, {count:,} model-weight elements, {_human(total)} of tensor data"
    )
    lines.append("  files:")
    for fname, info in sorted(idx["files"].items()):
        lines.append(f"    {fname:<32} {_human(info['bytes']):>10}")
    return "\n".join(lines)


def inspect(plait_root: str, tag: str | None = None, file=None) -> str:
    """Print ``describe(plait_root, tag)`` to ``file`` (default stdout) and return it."""
    text = describe(plait_root, tag)
    print(text, file=file or sys.stdout)
    return text
