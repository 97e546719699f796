"""The host memory of plait's CPU optimizer runtime (numba, llvmlite, the compiled kernels, the thread pool):
the peak resident set (VmHWM) of a tiny offloaded run minus that of the same run without offload, on the CPU.

    python benchmarks/probe_host_runtime.py            (prints one RESULT {json} line)

Each arm runs in a fresh process: an unmodified ``transformers.LlamaForCausalLM`` (hidden 64, 2 layers: its
states are kilobytes), ``plait.initialize`` with ZeRO-2, two steps. ``cold``: an empty ``NUMBA_CACHE_DIR`` (the
kernels compile, as on a freshly started machine); ``warm``: the same cache again (they load).
``plait.fit.host.CPU_OPTIMIZER_RUNTIME_BYTES`` cites the cold difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ARM = r"""
import json, sys, torch, transformers, plait
def hwm():
    return {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in open("/proc/self/status"))
            if k in ("VmHWM", "VmRSS")}
before = hwm()
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
zero = {"stage": 2}
if sys.argv[1] == "offload":
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
engine = plait.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero})
for i in range(2):
    ids = torch.randint(0, 256, (2, 64))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
print("RESULT " + json.dumps({"before": before, "after": hwm()}))
"""


def run(mode: str, cache: str) -> dict:
    env = {
        **os.environ,
        "NUMBA_CACHE_DIR": cache,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    done = subprocess.run(
        [sys.executable, "-c", ARM, mode], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(
        next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:]
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        base = run("none", cache)
        cold = run("offload", cache)
        warm = run("offload", cache)
    out = {
        "none": base,
        "offload_cold": cold,
        "offload_warm": warm,
        "runtime_cold": cold["after"]["VmHWM"] - base["after"]["VmHWM"],
        "runtime_warm": warm["after"]["VmHWM"] - base["after"]["VmHWM"],
    }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
