"""Measured peaks against ``plait.fit``'s predictions: the tables of ``results/estimate_memory.md``.

    python benchmarks/estimate_memory_table.py

``RECORDS``: the plait arms of the Trainer benchmark (``bench_hf_trainer.py``: an unmodified Llama, sequence
2048, bf16, AdamW, GAS 1, one GPU) whose settings are known, each with those settings; GPU and host peaks.
``OFFLOAD_FILES``: every plait row with a host peak of ``bench_offload.py`` (plait's own Llama built on the
GPU: host peaks only, its GPU peak is not the Hugging Face block ``plait.fit.activations`` models).
``EXCLUDED``: the records with a peak that are not predicted, and why. ``tests/test_estimate_memory_plan.py``
recomputes the tables and asserts every prediction within ``TOLERANCE`` of its measurement, and that
dropping any host term named in ``TERMS`` takes some prediction out of it.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from plait.fit import Settings, estimate, preset_shape
from plait.fit.host import host_peak
from plait.fit.plan import resident_elements
from plait.fit.shape import ModelShape

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TOLERANCE = 0.10
GiB = 2**30


def llama(hidden, layers, heads, kv, ffn) -> ModelShape:
    """``bench_offload.SIZES``' Llama shapes with vocabulary 32000, untied head."""
    return ModelShape(
        f"llama h{hidden} x{layers}", 32000, hidden, layers, heads, kv, hidden // heads, ffn
    )


TINYLLAMA = llama(2048, 22, 32, 4, 5632)
GPU_FIRST = dict(micro_batch=4, checkpointing=True, stage=3, offload_optimizer=True)
#: (file, arm) -> (shape, settings beyond sequence 2048 and the machine's sizes, which the peaks do not depend on);
#: the Trainer script builds the 1.1B model from its config on the host (fp32), the GPU-first runs read theirs
#: with ``plait.hf.from_pretrained`` (meta parameters)
RECORDS = {
    ("gpu_first_1xH200.jsonl", "plait-z3-gpufirst-7b"): (
        llama(4096, 32, 32, 32, 11008),
        dict(GPU_FIRST, ratio=0.2),
    ),
    ("gpu_first_1xH200.jsonl", "plait-z3-gpufirst-13b"): (
        llama(5120, 40, 40, 40, 13824),
        dict(GPU_FIRST, ratio=0.5),
    ),
    ("hf_trainer_1xH100.jsonl", "plait-z2-offload"): (
        TINYLLAMA,
        dict(micro_batch=4, stage=2, offload_optimizer=True, model_build="fp32"),
    ),
    ("hf_trainer_estimate_1xH200.jsonl", "plait-z2-offload"): (
        TINYLLAMA,
        dict(micro_batch=4, stage=2, offload_optimizer=True, model_build="fp32"),
    ),
    ("hf_trainer_estimate_1xH200.jsonl", "plait-z3"): (
        TINYLLAMA,
        dict(micro_batch=4, stage=3, model_build="fp32"),
    ),
    # int8 moments; reduce_bucket_size "auto" filled by transformers with hidden^2 (bench_offload's "21b")
    ("hf_trainer_int8_1xH200.jsonl", "plait-z3-gpufirst-21b"): (
        llama(6144, 52, 48, 8, 16384),
        dict(GPU_FIRST, ratio=0.5, state_dtype="int8", bucket_numel=6144 * 6144),
    ),
}
#: records measured before CopyBack stopped allocating a bf16 copy-out buffer for the groups whose optimizer states
#: stay on the GPU (never written; 2 B per resident element on the host): that code's term, added to today's plan
OLD_RESIDENT_COPY_OUT = "bf16 copy-out buffer of the resident share (code of the record)"
BEFORE_COPY_OUT_FIX = {
    ("gpu_first_1xH200.jsonl", "plait-z3-gpufirst-7b"),
    ("gpu_first_1xH200.jsonl", "plait-z3-gpufirst-13b"),
}
#: bench_offload.py's rows: part a ZeRO-2 + offload_optimizer at micro-batch 4, part b ZeRO-3 + offload_optimizer +
#: offload_param at micro-batch 1 (its ``ds_config``, pin_memory on both); the model built on the GPU
OFFLOAD_FILES = ("offload_1xH200_session2.md", "offload_default_1xH100.jsonl")
OFFLOAD_PARTS = {
    "a": dict(micro_batch=4, stage=2, offload_optimizer=True),
    "b": dict(micro_batch=1, stage=3, offload_optimizer=True, offload_param=True),
}
OFFLOAD_SIZES = {"886m": None, "5b": (4096, 24, 32, 8, 11008), "7b": (4096, 32, 32, 32, 11008)}
#: the record ``plait.fit.host.PROCESS_BASELINE_BYTES`` is measured from (its error is 0 by construction)
BASELINE_SOURCE = "offload_1xH200_session2.md plait 886m a #1"
#: the host terms of the model; each one dropped must take some recorded peak out of TOLERANCE
TERMS = (
    "process",
    "model build",
    "fp32 master weights",
    "Adam moments",
    "gradient shard",
    "bf16 copy-out buffer",
    OLD_RESIDENT_COPY_OUT,
    "weights (bf16)",
)
#: too small to move any recorded peak by 1% (0.07 GiB): cited from benchmarks/probe_host_runtime.py, not asserted
BELOW_RESOLUTION = ("CPU optimizer runtime",)
EXCLUDED = {
    "hf_trainer_1xH100.jsonl plait-z3": "ZeRO-3 before issue 14's changes (kept gathered weights and gradients): "
    "38.1 GiB then, 30.2 GiB now (hf_trainer_estimate_1xH200.jsonl)",
    "hf_trainer_largest_1xH200.jsonl plait-z3-offload-3b": "its peak is the fp32 model the Trainer then built on "
    "the GPU before partitioning (the record's own notes)",
    "offload_1xH100.md plait (886m 17.35, 1b 24.77, 3b 58.22 GiB host)": "code of before 21c4d79 (2026-11-22 01:05): "
    "pinned host buffers from torch's caching host allocator, rounded up to a power of two, and (before 9c9e6df) "
    "an fp32 gradient shard; today's code allocates neither (see results/estimate_memory.md)",
    "ds-*, fsdp2 arms": "other frameworks' memory, not plait's plan",
    "long_seq, moe_layer": "plait's own model and layer benchmarks (tiled MLP, fused loss, single layers), no host "
    "peak recorded",
}


def _records(name: str) -> list[dict]:
    with open(os.path.join(RESULTS, name)) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def offload_shape(size: str) -> ModelShape:
    """bench_offload's ``model_config(size)`` as a shape: the llama-886m preset with the size's widths."""
    base = preset_shape("llama-886m")
    if OFFLOAD_SIZES[size] is None:
        return base
    h, layers, heads, kv, ffn = OFFLOAD_SIZES[size]
    return replace(
        base,
        name=f"bench_offload {size}",
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=h // heads,
        ffn_hidden_size=ffn,
    )


def cases() -> list[tuple[str, dict, ModelShape, dict, int]]:
    """``(record name, record, shape, settings, bytes of the record's code that today's plan lacks)`` of every
    predicted record."""
    out = []
    for (name, arm), (shape, kw) in RECORDS.items():
        record = next(r for r in _records(name) if r.get("arm") == arm)
        old = (
            2 * resident_elements(shape, kw["stage"], kw["ratio"])
            if (name, arm) in BEFORE_COPY_OUT_FIX
            else 0
        )
        out.append((f"{name} {arm}", record, shape, kw, old))
    for name in OFFLOAD_FILES:
        seen: dict[tuple, int] = {}
        for r in _records(name):
            if r.get("framework") == "plait" and r.get("host_rss_gib"):
                key = (r["size"], r["part"])
                seen[key] = seen.get(key, 0) + 1
                out.append(
                    (
                        f"{name} plait {r['size']} {r['part']} #{seen[key]}",
                        {**r, "peak_gib": None, "host_peak_gib": r["host_rss_gib"]},
                        offload_shape(r["size"]),
                        OFFLOAD_PARTS[r["part"]],
                        0,
                    )
                )
    return out


def predicted_host(plan, old_code: int, drop: str | None = None) -> int:
    """The plan's host peak with ``old_code`` bytes of the record's code added to the states, or with the term
    or state row named ``drop`` left out (``TERMS``)."""
    terms = tuple((n, 0 if drop and n.startswith(drop) else b) for n, b in plan.host_terms)
    states = sum(
        r[2]
        for r in plan.rows
        if not (
            drop and (r[0] == drop or (r[0].startswith(drop) and drop != "bf16 copy-out buffer"))
        )
    )
    return host_peak(terms, states + (0 if drop == OLD_RESIDENT_COPY_OUT else old_code))


def rows(drop: str | None = None) -> list[dict]:
    """One row per predicted record: measured and predicted GPU and host peaks (GiB; None: not measured or
    not predicted), and the host terms (GiB)."""
    out = []
    for name, record, shape, kw, old in cases():
        assert record["params"] == shape.params, (name, record["params"], shape.params)
        plan = estimate(shape, Settings(gpu_bytes=1 << 40, host_bytes=1 << 40, seq_len=2048, **kw))
        out.append(
            {
                "record": name,
                "params": shape.params,
                "gpu": record.get("peak_gib"),
                "gpu_pred": plan.gpu_peak / GiB if record.get("peak_gib") else None,
                "host": record.get("host_peak_gib"),
                "host_pred": predicted_host(plan, old, drop) / GiB,
                "terms": {n.split(" (")[0]: b / GiB for n, b in plan.host_terms},
                "states": (plan.host_states + old) / GiB,
                "resident_copy_out": old / GiB,
            }
        )
    return out


def _err(pred, meas) -> str:
    return f"{pred / meas - 1:+.1%}" if pred is not None and meas else "-"


def _num(x) -> str:
    return f"{x:.2f}" if x is not None else "-"


def table(measured: list[dict]) -> str:
    lines = [
        "| record | params | GPU peak GiB measured | predicted | error | host peak GiB measured | predicted "
        "| error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in measured:
        lines.append(
            f"| {r['record']} | {r['params'] / 1e9:.2f}B | {_num(r['gpu'])} | {_num(r['gpu_pred'])} | "
            f"{_err(r['gpu_pred'], r['gpu'])} | {_num(r['host'])} | {_num(r['host_pred'])} | "
            f"{_err(r['host_pred'], r['host'])} |"
        )
    return "\n".join(lines)


def host_table(measured: list[dict]) -> str:
    """The host terms of each record with a host peak (GiB)."""
    lines = [
        "| record | process | CPU optimizer runtime | model build copy | host states (of which the record's "
        "code's resident copy-out) | predicted | measured | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in measured:
        if r["host"]:
            t = r["terms"]
            lines.append(
                f"| {r['record']} | {t['process']:.2f} | {t['CPU optimizer runtime']:.2f} | "
                f"{t['model build copy']:.2f} | {r['states']:.2f} ({r['resident_copy_out']:.2f}) | "
                f"{r['host_pred']:.2f} | {r['host']:.2f} | {_err(r['host_pred'], r['host'])} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    measured = rows()
    print(table(measured))
    print()
    print(host_table(measured))
