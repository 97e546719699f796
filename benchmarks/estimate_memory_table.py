"""Measured peaks against ``plait.fit``'s predictions: the table of ``results/estimate_memory.md``.

    python benchmarks/estimate_memory_table.py

``RECORDS``: the plait arms of ``results/*.jsonl`` whose settings are known, each with the settings it ran with
(the Trainer script of ``bench_hf_trainer.py``: an unmodified Llama, sequence 2048, bf16, AdamW, GAS 1, one GPU).
``EXCLUDED``: the records with a peak that are not predicted, and why. ``tests/test_estimate_memory.py``
recomputes the table from the records and asserts every prediction within ``TOLERANCE`` of its measurement.
"""
from __future__ import annotations

import json
import os

from plait.fit import Settings, estimate
from plait.fit.shape import ModelShape

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TOLERANCE = 0.10
GiB = 2**30


def llama(hidden, layers, heads, kv, ffn) -> ModelShape:
    """``bench_offload.SIZES``' Llama shapes with vocabulary 32000, untied head."""
    return ModelShape(f"llama h{hidden} x{layers}", 32000, hidden, layers, heads, kv, hidden // heads, ffn)


TINYLLAMA = llama(2048, 22, 32, 4, 5632)
GPU_FIRST = dict(micro_batch=4, checkpointing=True, stage=3, offload_optimizer=True)
#: (file, arm) -> (shape, settings beyond sequence 2048 and the machine's sizes, which the peaks do not depend on)
RECORDS = {
    ("gpu_first_1xH200.jsonl", "plait-z3-gpufirst-7b"): (llama(4096, 32, 32, 32, 11008), dict(GPU_FIRST, ratio=0.2)),
    ("gpu_first_1xH200.jsonl", "plait-z3-gpufirst-13b"): (llama(5120, 40, 40, 40, 13824), dict(GPU_FIRST, ratio=0.5)),
    ("hf_trainer_1xH100.jsonl", "plait-z2-offload"): (TINYLLAMA, dict(micro_batch=4, stage=2, offload_optimizer=True)),
    ("hf_trainer_estimate_1xH200.jsonl", "plait-z2-offload"): (TINYLLAMA, dict(micro_batch=4, stage=2,
                                                                               offload_optimizer=True)),
    ("hf_trainer_estimate_1xH200.jsonl", "plait-z3"): (TINYLLAMA, dict(micro_batch=4, stage=3)),
}
EXCLUDED = {
    "hf_trainer_1xH100.jsonl plait-z3": "ZeRO-3 before issue 14's changes (kept gathered weights and gradients): "
                                        "38.1 GiB then, 30.2 GiB now (hf_trainer_estimate_1xH200.jsonl)",
    "hf_trainer_largest_1xH200.jsonl plait-z3-offload-3b": "its peak is the fp32 model the Trainer then built on "
                                                           "the GPU before partitioning (the record's own notes)",
    "ds-*, fsdp2 arms": "other frameworks' memory, not plait's plan",
    "long_seq, moe_layer, offload_default": "plait's own model and layer benchmarks (tiled MLP, fused loss, "
                                            "single layers), not the Hugging Face Llama block this models",
}


def rows() -> list[dict]:
    """One row per record of ``RECORDS``: measured and predicted GPU (and host where measured) peaks, GiB."""
    out = []
    for (name, arm), (shape, kw) in RECORDS.items():
        with open(os.path.join(RESULTS, name)) as f:
            record = next(r for r in map(json.loads, filter(str.strip, f)) if r.get("arm") == arm)
        assert record["params"] == shape.params, (arm, record["params"], shape.params)
        plan = estimate(shape, Settings(gpu_bytes=1 << 40, host_bytes=1 << 40, seq_len=2048, **kw))
        row = {"record": f"{name} {arm}", "params": shape.params, "gpu": record["peak_gib"],
               "gpu_pred": plan.gpu_peak / GiB, "host": record.get("host_peak_gib"), "host_pred": plan.host_peak / GiB}
        out.append(row)
    return out


def table(measured: list[dict]) -> str:
    lines = ["| record | params | GPU peak GiB measured | predicted | error | host peak GiB measured | predicted "
             "| error |", "|---|---|---|---|---|---|---|---|"]
    for r in measured:
        host = f"{r['host']:.2f} | {r['host_pred']:.2f} | {r['host_pred'] / r['host'] - 1:+.1%}" if r["host"] else \
            f"- | {r['host_pred']:.2f} | -"
        lines.append(f"| {r['record']} | {r['params'] / 1e9:.2f}B | {r['gpu']:.2f} | {r['gpu_pred']:.2f} | "
                     f"{r['gpu_pred'] / r['gpu'] - 1:+.1%} | {host} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(rows()))
